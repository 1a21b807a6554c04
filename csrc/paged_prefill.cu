// Head-dim dispatch for the prefill kernel (one file per head dim: parallel builds).
#include "nvfp4_kernels.h"

namespace nvfp4 {
cudaError_t launch_paged_prefill_hd64(const PrefillParams& p, cudaStream_t stream);
cudaError_t launch_paged_prefill_hd128(const PrefillParams& p, cudaStream_t stream);
cudaError_t launch_paged_prefill_hd256(const PrefillParams& p, cudaStream_t stream);

cudaError_t launch_paged_prefill(const PrefillParams& p, cudaStream_t stream) {
  if (p.group_size < 1 || p.group_size > prefill_rows(p.head_dim) || p.tile_tokens != prefill_rows(p.head_dim) / p.group_size ||
      p.page_size < 1 || p.num_tiles < 0)
    return cudaErrorInvalidValue;
  if (p.batch == 0 || p.num_tiles == 0) return cudaSuccess;
  switch (p.head_dim) {
    case 64: return launch_paged_prefill_hd64(p, stream);
    case 128: return launch_paged_prefill_hd128(p, stream);
    case 256: return launch_paged_prefill_hd256(p, stream);
    default: return cudaErrorInvalidValue;
  }
}
}  // namespace nvfp4
