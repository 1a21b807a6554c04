// Where a decode thread block works (request, split, kv heads), where its threads are (warp, MMA
// lane), and which query rows each warp holds: StaticRows for the static kernels, FusedRows for the
// fused kernel (docs/kernels.md#decode).
#pragma once
#include <cstdint>
#include "decode_config.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// Both kernels' block and thread indices and the request's query rows; each kernel reads its own part.
struct BlockPlace {
  int split, req, warp, lane;
  int g, c;  // MMA group id / thread-in-group
  int row_warp, token_warp;
  int head_shift, kv_base, heads_here;  // the block's kv heads: kv_base ..+ heads_here (<= 1 << head_shift)
  // the static kernels' heads (heads_per_block > 1 only with one row warp and q_len 1, the binding
  // checks): token warp w streams head w >> warp_head_shift, whose tiles are 64 >> head_shift
  // (1 << tile_shift) tokens long; its 16 tokens of each are sub-tile (w & sub_mask).  Query row r:
  // token r / row_group of the request, q head kv_base * group + r % row_group (with several heads q_len
  // is 1, so the rows are the heads' q heads in order)
  int tile_shift, warp_head_shift, sub_mask, row_group;
  // the fused kernel: warp w streams head w % heads (warp_head, so a head's warps spread over the warp
  // schedulers alike), the warp_rank-th of its warps_per_head
  int warp_head, warp_rank, warps_per_head;
  int q_start, q_len, seq_len;
  // max_rows bounds the partial-output rows per kv head; the host sizes it from max_query_len
  int head_rows;  // <= 0 for an empty request: no query loads
  int rows;

  // The request's three loads go out together (the early return for an empty request comes after the
  // query loads: before them, nvcc sank the sequence length's load below it, a second memory latency
  // before the first copies).
  __device__ __forceinline__ BlockPlace(const DecodeParams& p, int token_warps, int warps)
      : split(blockIdx.x), req(blockIdx.z), warp(threadIdx.x / 32), lane(threadIdx.x % 32), g(lane >> 2), c(lane & 3),
        row_warp(warp / token_warps), token_warp(warp % token_warps), head_shift(p.heads_per_block_log2),
        kv_base(blockIdx.y << head_shift), heads_here(min(1 << head_shift, p.num_kv_heads - kv_base)),
        tile_shift(6 - head_shift), warp_head_shift(2 - head_shift), sub_mask((4 >> head_shift) - 1),
        row_group(p.group_size << head_shift), warp_head(warp & ((1 << head_shift) - 1)), warp_rank(warp >> head_shift),
        warps_per_head(warps >> head_shift), q_start(p.query_start_loc[req]),
        q_len(p.query_start_loc[req + 1] - q_start), seq_len(p.seq_lens[req]),
        head_rows(min(q_len * p.group_size, p.max_rows)), rows(head_rows * heads_here) {}
};

// The split's cache positions [begin, end): positions visible to the first query row bound the range
// every row may need.  Every query row sees every position up to first_qpos (the first row's own).
struct KvSplit {
  int first_qpos, begin, end;
  __device__ __forceinline__ KvSplit(const DecodeParams& p, const BlockPlace& b) {
    int kv_begin = 0;
    if (p.sliding_window > 0) kv_begin = max(0, b.seq_len - b.q_len - p.sliding_window + 1);
    first_qpos = b.seq_len - b.q_len;
    const int kv_len = max(b.seq_len - kv_begin, 0);
    const int split_len = (kv_len + p.num_splits - 1) / p.num_splits;
    begin = kv_begin + b.split * split_len;
    end = min(begin + split_len, b.seq_len);
  }
};

// query row -> the element offset of its (token, q head) in q or out, given their strides
template <class Rows>
__device__ __forceinline__ int64_t row_offset(const DecodeParams& p, const Rows& b, int row, int64_t stride_token,
                                              int64_t stride_head) {
  return (int64_t)(b.q_start + b.token(p, row)) * stride_token + (int64_t)b.q_head(p, row) * stride_head;
}

// The static kernels: every warp holds all the block's rows of its row warp; row r of the block is
// row tile r / 8 % kRowTiles of row warp r / kRowsPerWarp.
template <class C>
struct StaticRows : BlockPlace {
  __device__ __forceinline__ explicit StaticRows(const DecodeParams& p) : BlockPlace(p, C::kTokenWarps, C::kWarps) {}
  __device__ __forceinline__ int token(const DecodeParams&, int row) const { return row / row_group; }
  __device__ __forceinline__ int q_head(const DecodeParams& p, int row) const { return kv_base * p.group_size + row % row_group; }
  // the block row of MMA row 0 of this warp's row tile t
  __device__ __forceinline__ int tile_first_row(int t) const { return (row_warp * C::kRowTiles + t) * 8; }
  // whether the block has this thread's row of row tile t: MMA row g (the query loads) or 2c + i (the
  // score masks)
  __device__ __forceinline__ bool query_live(int t) const {
    const int row = tile_first_row(t) + g;
    return row < rows;
  }
  __device__ __forceinline__ bool row_live(int t, int i) const {
    const int row = tile_first_row(t) + 2 * c + i;
    return row < rows;
  }
  // the start of a live row's query (for another row, some row of the request): row_offset spelled
  // out, which compiles to a different prologue here (not measured)
  template <typename T>
  __device__ __forceinline__ const T* query_row(const DecodeParams& p, int row, bool live) const {
    return static_cast<const T*>(p.q) + (int64_t)(q_start + (live ? row / row_group : 0)) * p.q_stride_token +
           (int64_t)(kv_base * p.group_size + (live ? row % row_group : 0)) * p.q_stride_head;
  }
  // the kv head of the tokens that warp w copies and reads
  __device__ __forceinline__ int copy_head(int w) const { return w >> warp_head_shift; }
  __device__ __forceinline__ int copy_first_token(int w) const { return (w & sub_mask) * 16; }
  // the Q^T operands in shared memory: one copy per row warp, stored by its first token warp
  __device__ __forceinline__ int operand_copy() const { return row_warp; }
  __device__ __forceinline__ bool stores_operands() const { return token_warp == 0; }
  // the merge: a row's slot in a warp's merge buffer, and whether warp w streamed the row's head
  __device__ __forceinline__ int merge_slot(int row, int) const { return row; }
  __device__ __forceinline__ bool streams(int w, int head) const { return (w >> warp_head_shift) == head; }
};

// The fused kernel: a warp holds its own head's rows only, block rows row_base ..+ head_rows; a head's
// row r is query token r / group_size, q head r % group_size of the kv head.
template <class C>
struct FusedRows : BlockPlace {
  int row_base;
  __device__ __forceinline__ explicit FusedRows(const DecodeParams& p)
      : BlockPlace(p, C::kTokenWarps, C::kWarps), row_base(warp_head * head_rows) {}
  __device__ __forceinline__ int token(const DecodeParams& p, int row) const { return row % head_rows / p.group_size; }
  __device__ __forceinline__ int q_head(const DecodeParams& p, int row) const {
    return (kv_base + row / head_rows) * p.group_size + row % head_rows % p.group_size;
  }
  __device__ __forceinline__ int tile_first_row(int t) const { return row_base + t * 8; }
  __device__ __forceinline__ bool query_live(int t) const { return t * 8 + g < head_rows && warp_head < heads_here; }
  __device__ __forceinline__ bool row_live(int t, int i) const { return t * 8 + 2 * c + i < head_rows; }
  // row_offset only for a live row: it divides by head_rows, which is 0 for an empty request
  template <typename T>
  __device__ __forceinline__ const T* query_row(const DecodeParams& p, int row, bool live) const {
    return static_cast<const T*>(p.q) + (live ? row_offset(p, *this, row, p.q_stride_token, p.q_stride_head) : 0);
  }
  __device__ __forceinline__ int copy_head(int) const { return warp_head; }
  __device__ __forceinline__ int copy_first_token(int) const { return 0; }
  // one copy of the Q^T operands per kv head, stored by the head's first warp
  __device__ __forceinline__ int operand_copy() const { return warp_head; }
  __device__ __forceinline__ bool stores_operands() const { return warp_rank == 0; }
  __device__ __forceinline__ int merge_slot(int row, int head) const { return row - head * head_rows; }
  __device__ __forceinline__ bool streams(int w, int head) const { return (w & ((1 << head_shift) - 1)) == head; }
};

}  // namespace decode
}  // namespace nvfp4
