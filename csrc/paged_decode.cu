// Head-dim dispatch for the decode kernel and its support rules, on the generated limits (nvfp4_limits.h).
#include "nvfp4_kernels.h"

namespace nvfp4 {
cudaError_t launch_paged_decode_hd64(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_paged_decode_hd128(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_paged_decode_hd256(const DecodeParams& p, cudaStream_t stream);

bool decode_heads_per_block_ok(int heads_per_block_log2, int max_rows, int group_size) {
  if (heads_per_block_log2 < 0 || heads_per_block_log2 > 8) return false;
  const int heads = 1 << heads_per_block_log2;
  return heads == 1 || (heads <= kPackedMaxHeads && max_rows == group_size && max_rows * heads <= kRowTile);
}

bool decode_fused_ok(int heads_per_block_log2, int max_rows, int head_dim) {
  if (heads_per_block_log2 < 0 || heads_per_block_log2 > 8 || max_rows < 1 || max_rows > kFusedMaxRows) return false;
  bool fused_head_dim = false;
  for (int d : kFusedHeadDims) fused_head_dim |= d == head_dim;
  const int row_tiles = (max_rows + kRowTile - 1) / kRowTile;
  return fused_head_dim && (1 << heads_per_block_log2) * row_tiles <= kFusedHeadTiles;
}

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
