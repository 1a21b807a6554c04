// The decode kernels' copies: a thread's part of each pipeline stage (K and V data and block scales of
// one token, cp.async into shared memory), the page lookups, and one softmax step's copies as one
// commit group (docs/kernels.md#decode).
#pragma once
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "decode_rows.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// A thread's fixed part of every copy.  Thread -> (token, half) of each stage: the token is one of its
// warp's 16 of the stage (static kernels: tokens copy_first_token .. + 15 of its head's part of the
// tile; the fused kernel: of its head's current step); its kv head; its 16 bytes of each 32-byte sector
// of the token's K and V data; and the K (half 0) or V (half 1) block scales.  The token's two threads
// copy a sector's two halves in one instruction: with each thread copying a contiguous half of the token
// instead, every sector was requested from L2 twice, by two instructions.  Page strides and offsets
// within a page fit 32 bits (the binding checks): 32 x 32 -> 64-bit multiply-adds (paged_source).
// kRowCopies (token-major caches, Config::kRowCopiesServe): kRowThreads threads per token, one 16-byte
// piece each of its row; copy j of a stage is token j * kRowTokens + row_sub of the warp's 16, whose
// page its owner lane (2 t) holds.
// The loop-invariant parts are opaque(): held in registers, where nvcc would otherwise recompute them
// from the parameters and the thread index for every tile (some 50 instructions per tile).
template <class C, bool kRowCopies>
struct StepCopies {
  static_assert(!kRowCopies || C::kRowCopiesServe, "row copies: kernels of one row warp");
  static constexpr int kRowThreads = C::kDataBytes / 16, kRowTokens = 32 / kRowThreads;
  const DecodeParams& p;
  int load_token, load_half;
  bool live;  // a block's last kv heads may be fewer: nothing to copy for a head the block lacks
  uint32_t page_mask;
  const int* table;
  int load_pos;  // this thread's token of tile 0 (the fused kernel: of step 0)
  int load_end;
  int tile_shift;
  int row_sub, row_delta;  // kRowCopies: the token of the warp's 16 this thread copies, its token - mine
  const uint8_t *k_src, *v_src, *scale_src;
  uint32_t data_page_stride, scale_page_stride, data_token_stride, scale_token_stride;
  uint32_t data_dst, scale_dst;  // shared addresses in stage 0

  template <class Rows>
  __device__ __forceinline__ StepCopies(const DecodeParams& params, const Rows& b, uint8_t* smem, const KvSplit& kv)
      : p(params), load_token(threadIdx.x >> 1), load_half(threadIdx.x & 1) {
    const int load_warp = load_token >> 4, load_head = b.copy_head(load_warp);
    live = load_head < b.heads_here;
    const int load_kv_head = b.kv_base + (live ? load_head : 0);
    page_mask = opaque(static_cast<uint32_t>((1 << p.page_size_log2) - 1));
    table = opaque(p.block_table + (int64_t)b.req * p.block_table_stride);
    load_pos = static_cast<int>(opaque(static_cast<uint32_t>(kv.begin + b.copy_first_token(load_warp) + (load_token & 15))));
    load_end = live ? kv.end : kv.begin;
    tile_shift = b.tile_shift;
    const int lane_in_warp = threadIdx.x & 31, row_piece = lane_in_warp % kRowThreads;
    row_sub = lane_in_warp / kRowThreads;
    row_delta = static_cast<int>(opaque(static_cast<uint32_t>(row_sub - (load_token & 15))));
    const int copy_offset = kRowCopies ? row_piece * 16 : load_half * 16;
    k_src = opaque(p.k_data + load_kv_head * p.data_strides.head + copy_offset);
    v_src = opaque(p.v_data + load_kv_head * p.data_strides.head + copy_offset);
    scale_src = opaque((load_half ? p.v_block_scales : p.k_block_scales) + load_kv_head * p.scale_strides.head);
    data_page_stride = static_cast<uint32_t>(p.data_strides.page);
    scale_page_stride = static_cast<uint32_t>(p.scale_strides.page);
    data_token_stride = static_cast<uint32_t>(p.data_strides.token);
    scale_token_stride = static_cast<uint32_t>(p.scale_strides.token);
    data_dst = opaque(smem_addr(smem) + (kRowCopies ? C::data_offset((load_token & ~15) + row_sub) : C::data_offset(load_token)) +
                      copy_offset);
    scale_dst = opaque(smem_addr(smem) + 2 * C::kDataStage + load_half * C::kScaleStage + load_token * C::kScaleBytes);
  }

  // this thread's token of tile `tile` (static kernels), of step `chunk`'s stage u (the fused kernel:
  // tokens begin + 32 chunk .. + 31, 16 per stage)
  __device__ __forceinline__ int tile_pos(int tile) const { return load_pos + (tile << tile_shift); }
  __device__ __forceinline__ int chunk_pos(int chunk, int u) const { return load_pos + (chunk << 5) + (u << 4); }
  // the page holding position pos, or -1 (none: the copies write zeros).  pos < load_end implies
  // tile < num_tiles (load_pos >= begin)
  __device__ __forceinline__ int page(int pos) const {
    return pos < load_end ? __ldg(table + (pos >> p.page_size_log2)) : -1;
  }
  __device__ __forceinline__ int tile_page(int tile) const {
    const int pos = tile_pos(tile);
    return pos < load_end ? __ldg(table + (pos >> p.page_size_log2)) : -1;
  }

  // The static kernels' step of tiles first_tile ..+ kTilesPerStep; the tiles past the last one, up to a
  // whole step (step_tiles), are copied as zeros (their pages are -1): the step reads them.
  __device__ __forceinline__ void issue_tiles(int first_tile, int step_tiles, const int* pages) const {
    issue(step_tiles > first_tile, first_tile, pages, [&](int u) { return tile_pos(first_tile + u); });
  }
  // The fused kernel's step `chunk` of its head, into the ring's stages first_tile % kStages ..
  __device__ __forceinline__ void issue_chunk(int first_tile, int chunk, int warp_chunks, const int* pages) const {
    issue(warp_chunks > chunk, first_tile, pages, [&](int u) { return chunk_pos(chunk, u); });
  }

  // The copies of one softmax step's tiles (kTilesPerStep consecutive stages), one commit group: the
  // stages' shared offsets differ by constants, and the step's tiles are all copied or none.  pages: the
  // step's kTilesPerStep page indices; pos(u): this thread's token of the step's stage u.
  template <class Pos>
  __device__ __forceinline__ void issue(bool copy, int first_tile, const int* pages, Pos pos) const {
    if (copy) {
      const uint32_t stage = (first_tile % kStages) * C::kStageBytes;
#pragma unroll
      for (int u = 0; u < C::kTilesPerStep; ++u) {
        const int page = pages[u];  // negative: no page, the copies write zeros
        const uint32_t in_page = static_cast<uint32_t>(pos(u)) & page_mask;
        const uint32_t page_index = static_cast<uint32_t>(max(page, 0));  // a page to point at when there is none
        const uint32_t dst = stage + u * C::kStageBytes;
        if constexpr (kRowCopies) {
#pragma unroll
          for (int j = 0; j < C::kDataBytes / 32; ++j) {
            const int row_page = __shfl_sync(0xffffffffu, page, 2 * (j * kRowTokens + row_sub));
            const uint32_t row_in_page = (in_page + row_delta + j * kRowTokens) & page_mask;
            const uint32_t row_page_index = static_cast<uint32_t>(max(row_page, 0));
            const uint32_t at = data_dst + dst + C::data_offset(j * kRowTokens);
            cp_async<16>(at, paged_source(k_src, row_page_index, data_page_stride, row_in_page, data_token_stride), row_page);
            cp_async<16>(at + C::kDataStage, paged_source(v_src, row_page_index, data_page_stride, row_in_page, data_token_stride),
                         row_page);
          }
        } else {
          const uint8_t* k = paged_source(k_src, page_index, data_page_stride, in_page, data_token_stride);
          const uint8_t* v = paged_source(v_src, page_index, data_page_stride, in_page, data_token_stride);
#pragma unroll
          for (int b = 0; b < C::kDataBytes; b += 32) {
            cp_async<16>(data_dst + dst + b, k + b, page);
            cp_async<16>(data_dst + dst + C::kDataStage + b, v + b, page);
          }
        }
        cp_async<C::kScaleBytes>(scale_dst + dst, paged_source(scale_src, page_index, scale_page_stride, in_page, scale_token_stride),
                                 page);
      }
    }
    cp_async_commit();
  }
};

// The page indices of the steps' copies: the first stages' load together (one table latency before
// the first copies, not a chain of them); later ones load one loop iteration ahead of their copies.
template <class C>
struct StepPages {
  int first[kStages];
  int next[C::kTilesPerStep];
  template <class StagePage>
  __device__ __forceinline__ explicit StepPages(StagePage stage_page) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) first[s] = stage_page(s);
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u) next[u] = first[kStages - C::kTilesPerStep + u];
  }
};

// Wait for this step's stages: a commit group per step.  With one row warp, a warp reads only the
// sub-tiles of each stage that its own lanes copy, so a warp barrier orders its copies and its reads,
// and the warps need not wait for each other every tile.  Row warps share their sub-tiles and need the
// block's barrier.
template <class C>
__device__ __forceinline__ void wait_for_step() {
  cp_async_wait<(kStages - 2 * C::kTilesPerStep) / C::kTilesPerStep>();
  if constexpr (C::kTokenWarps == C::kWarps) __syncwarp();
  else __syncthreads();
}

}  // namespace decode
}  // namespace nvfp4
