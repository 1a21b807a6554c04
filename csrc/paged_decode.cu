// Head-dim dispatch for the decode kernel: the one table of supported head dims and row limits.
#include "nvfp4_kernels.h"

namespace nvfp4 {
cudaError_t launch_paged_decode_hd64(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_paged_decode_hd128(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_paged_decode_hd256(const DecodeParams& p, cudaStream_t stream);

int decode_max_rows(int head_dim) {
  switch (head_dim) {
    case 64: case 128: return 64;
    case 256: return 32;
    default: return 0;
  }
}

bool decode_heads_per_block_ok(int heads_per_block_log2, int max_rows, int group_size) {
  if (heads_per_block_log2 < 0 || heads_per_block_log2 > 2) return false;
  return heads_per_block_log2 == 0 || (max_rows == group_size && (max_rows << heads_per_block_log2) <= 8);
}

bool decode_fused_ok(int heads_per_block_log2, int max_rows, int head_dim) {
  const int max_heads_log2 = max_rows <= 8 ? 3 : 2;
  return (head_dim == 64 || head_dim == 128) && max_rows >= 1 && max_rows <= 16 && heads_per_block_log2 >= 0 &&
         heads_per_block_log2 <= max_heads_log2;
}

int decode_fused_warps(int max_rows) { return max_rows <= 8 ? 16 : 12; }

cudaError_t launch_paged_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.max_rows <= 0 || p.max_rows > decode_max_rows(p.head_dim)) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.fused_warps != 0) {
    if (!decode_fused_ok(p.heads_per_block_log2, p.max_rows, p.head_dim) || p.fused_warps != decode_fused_warps(p.max_rows))
      return cudaErrorInvalidValue;
  } else if (!decode_heads_per_block_ok(p.heads_per_block_log2, p.max_rows, p.group_size)) {
    return cudaErrorInvalidValue;
  }
  switch (p.head_dim) {
    case 64: return launch_paged_decode_hd64(p, stream);
    case 128: return launch_paged_decode_hd128(p, stream);
    case 256: return launch_paged_decode_hd256(p, stream);
    default: return cudaErrorInvalidValue;
  }
}
}  // namespace nvfp4
