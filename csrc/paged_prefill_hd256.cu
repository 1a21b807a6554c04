// Prefill kernel instantiations for head_dim 256.
#include "prefill_kernel.cuh"

namespace nvfp4 {
cudaError_t launch_paged_prefill_hd256(const PrefillParams& p, cudaStream_t stream) {
  return prefill::launch_for_dtype<256>(p, stream);
}
}  // namespace nvfp4
