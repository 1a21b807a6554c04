// Decode kernel instantiations for head_dim 64 (one file per head dim: parallel builds).
#include "decode_kernel.cuh"

namespace nvfp4 {
cudaError_t launch_paged_decode_hd64(const DecodeParams& p, cudaStream_t stream) {
  return p.dtype == QueryType::kBFloat16 ? decode::launch_for_rows<__nv_bfloat16, 64>(p, stream)
                                         : decode::launch_for_rows<__half, 64>(p, stream);
}
}  // namespace nvfp4
