// Prefill kernel instantiations for head_dim 64.
#include "prefill_kernel.cuh"

namespace nvfp4 {
cudaError_t launch_paged_prefill_hd64(const PrefillParams& p, cudaStream_t stream) {
  return prefill::launch_for_dtype<64>(p, stream);
}
}  // namespace nvfp4
