// The decode kernel's copies: a thread's part of each cp.async stage (Copies, planned by plan_copies),
// the page lookups, and one softmax step's copies as one commit group.  Why each choice:
// docs/kernels.md#decode; why the steps take what they take: docs/kernels.md#decode-steps.
#pragma once
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// Thread -> (token, half) of each stage; the token is one of its warp's 16 of the stage, which are
// tokens (w & sub_mask) * 16 .. + 15 of head w >> warp_head_shift's part (the fused kernel: of its
// head's current step, chunk_pos).  The thread's fixed part of each copy: its kv head, its 16 bytes of
// each 32-byte sector of a token's K and V data, and the K (half 0) or V (half 1) block scales.  The
// token's two threads copy a sector's two halves in one instruction: with each thread copying a
// contiguous half of the token instead, every sector was requested from L2 twice, by two
// instructions.  Page strides and offsets within a page fit 32 bits (the binding checks), so the
// addresses are 32 x 32 -> 64-bit multiply-adds (paged_source).
// kRowCopies (token-major caches, see Config::kRowCopiesServe): kRowThreads threads per token, one
// 16-byte piece each of its row; copy j of a stage is token j * kRowTokens + row_sub of the warp's 16,
// whose page its owner lane (2 t) holds.
template <typename C, bool kRowCopies>
struct Copies {
  static constexpr int kRowThreads = C::kDataBytes / 16, kRowTokens = 32 / kRowThreads;
  const DecodeParams* p;
  int tile_shift;
  // the loop-invariant parts of the copies are opaque(): held in registers, where nvcc would otherwise
  // recompute them from the parameters and the thread index for every tile (docs/kernels.md#decode)
  uint32_t page_mask;
  const int* table;
  int load_pos;     // this thread's token of tile 0
  int load_end;     // nothing to copy for a head the block lacks
  int warp_chunks;  // the fused kernel: the steps of the warp's head (none for a head the block lacks)
  int row_sub, row_delta;  // kRowCopies: the token of copy 0 in the warp's 16, and its token - mine
  const uint8_t *k_src, *v_src, *scale_src;
  uint32_t data_page_stride, scale_page_stride, data_token_stride, scale_token_stride;
  uint32_t data_dst, scale_dst;  // shared addresses in stage 0
  // tiles past the last one, up to a whole step, are copied as zeros (their pages are -1): the step reads them
  int step_tiles;

  __device__ __forceinline__ int pos_of(int tile) const { return load_pos + (tile << tile_shift); }
  // the fused kernel's step `chunk` of a head: tokens begin + 32 chunk .. + 31, 16 per stage
  __device__ __forceinline__ int chunk_pos(int chunk, int u) const { return load_pos + (chunk << 5) + (u << 4); }
  __device__ __forceinline__ int page_at(int pos) const { return pos < load_end ? __ldg(table + (pos >> p->page_size_log2)) : -1; }
  __device__ __forceinline__ int page_of(int tile) const {
    const int pos = pos_of(tile);  // pos < load_end implies tile < num_tiles (load_pos >= begin)
    return pos < load_end ? __ldg(table + (pos >> p->page_size_log2)) : -1;
  }

  // ---------------------------------------------------------------- step 2: one step's copies
  // The copies of one softmax step's tiles (kTilesPerStep consecutive stages), one commit group: the
  // stages' shared offsets differ by constants, and the step's tiles are all copied or none (the fused
  // kernel: the ring's stages first_tile % kStages.., the tokens of its step `chunk`).  pages: the
  // step's kTilesPerStep page indices.
  __device__ __forceinline__ void issue_step(int first_tile, int chunk, const int* pages) const {
    if (C::kFused ? chunk < warp_chunks : first_tile < step_tiles) {
      const uint32_t stage = (first_tile % kStages) * C::kStageBytes;
#pragma unroll
      for (int u = 0; u < C::kTilesPerStep; ++u) {
        const int page = pages[u];  // negative: no page, the copies write zeros
        const uint32_t in_page = static_cast<uint32_t>(C::kFused ? chunk_pos(chunk, u) : pos_of(first_tile + u)) & page_mask;
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

  // The first stages' page indices load together (one table latency before the first copies, not a
  // chain of them); later ones load one loop iteration ahead of their copies (next_page)
  __device__ __forceinline__ void first_pages(int (&pages)[kStages], int (&next_page)[C::kTilesPerStep], int chunk_cur,
                                              int chunk_next) const {
#pragma unroll
    for (int s = 0; s < kStages; ++s)
      pages[s] = C::kFused ? page_at(chunk_pos(s < 2 ? chunk_cur : chunk_next, s & 1)) : page_of(s);
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u) next_page[u] = pages[kStages - C::kTilesPerStep + u];
  }
  // the pipeline's first steps (the fused kernel's one step: kStages 4)
  __device__ __forceinline__ void issue_prologue(const int& chunk_cur, const int (&pages)[kStages]) const {
#pragma unroll
    for (int s = 0; s < kStages - C::kTilesPerStep; s += C::kTilesPerStep) issue_step(s, chunk_cur, &pages[s]);
  }
};

// The thread's Copies.  tid is the kernel's threadIdx.x, whose range the kernel's launch bounds give
template <typename C, bool kRowCopies>
__device__ __forceinline__ void plan_copies(Copies<C, kRowCopies>& cp, const DecodeParams& p, uint8_t* smem, int req, int kv_base,
                                            int heads_here, int warp_head, int warp_head_shift, int sub_mask, int tile_shift,
                                            int begin, int end, int num_tiles, unsigned tid) {
  constexpr int kRowThreads = C::kDataBytes / 16;
  cp.p = &p;
  cp.tile_shift = tile_shift;
  const int load_token = tid >> 1, load_half = tid & 1;
  const int load_warp = load_token >> 4, load_head = C::kFused ? warp_head : load_warp >> warp_head_shift;
  const bool load_live = load_head < heads_here;  // a block's last kv heads may be fewer
  const int load_kv_head = kv_base + (load_live ? load_head : 0);
  cp.page_mask = opaque(static_cast<uint32_t>((1 << p.page_size_log2) - 1));
  cp.table = opaque(p.block_table + (int64_t)req * p.block_table_stride);
  cp.load_pos = static_cast<int>(
      opaque(static_cast<uint32_t>(begin + (C::kFused ? 0 : (load_warp & sub_mask) * 16) + (load_token & 15))));
  cp.load_end = load_live ? end : begin;
  const int num_chunks = end > begin ? (end - begin + 31) >> 5 : 0;
  cp.warp_chunks = load_live ? num_chunks : 0;
  const int lane_in_warp = tid & 31, row_piece = lane_in_warp % kRowThreads, row_sub = lane_in_warp / kRowThreads;
  cp.row_sub = row_sub;
  cp.row_delta = static_cast<int>(opaque(static_cast<uint32_t>(row_sub - (load_token & 15))));
  const int copy_offset = kRowCopies ? row_piece * 16 : load_half * 16;
  cp.k_src = opaque(p.k_data + load_kv_head * p.data_strides.head + copy_offset);
  cp.v_src = opaque(p.v_data + load_kv_head * p.data_strides.head + copy_offset);
  cp.scale_src = opaque((load_half ? p.v_block_scales : p.k_block_scales) + load_kv_head * p.scale_strides.head);
  cp.data_page_stride = static_cast<uint32_t>(p.data_strides.page);
  cp.scale_page_stride = static_cast<uint32_t>(p.scale_strides.page);
  cp.data_token_stride = static_cast<uint32_t>(p.data_strides.token);
  cp.scale_token_stride = static_cast<uint32_t>(p.scale_strides.token);
  cp.data_dst = opaque(smem_addr(smem) + (kRowCopies ? C::data_offset((load_token & ~15) + row_sub)
                                                      : C::data_offset(load_token)) + copy_offset);
  cp.scale_dst = opaque(smem_addr(smem) + 2 * C::kDataStage + load_half * C::kScaleStage + load_token * C::kScaleBytes);
  cp.step_tiles = (num_tiles + C::kTilesPerStep - 1) / C::kTilesPerStep * C::kTilesPerStep;
}

}  // namespace decode
}  // namespace nvfp4
