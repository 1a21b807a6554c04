// Decode kernel instantiations for head_dim 256 (one file per head dim: parallel builds).
#include "decode_kernel.cuh"

namespace nvfp4 {
cudaError_t launch_paged_decode_hd256(const DecodeParams& p, cudaStream_t stream) {
  return p.dtype == QueryType::kBFloat16 ? decode::launch_for_rows<__nv_bfloat16, 256>(p, stream)
                                         : decode::launch_for_rows<__half, 256>(p, stream);
}
}  // namespace nvfp4
