// Paged NVFP4 attention for decode / spec-decode / short extends.  Included by the
// paged_decode_hd*.cu files, one per head dim, so ninja builds them in parallel.
//
// Design (docs/kernels.md#decode says why):
//  * grid (num_splits, num_kv_heads / heads_per_block, batch): one thread block streams one split of
//    one request's KV range for one kv head, once, for ALL its query rows (q_len x group, up to 64), so
//    every K/V byte is read from memory once per step.  Plain decode with few rows per head may pack
//    2 or 4 kv heads into a block (heads_per_block): each stage then holds 32 or 16 tokens of each
//    head, each warp streams one head's share, and the block's rows are the heads' rows side by side.
//    Half or a quarter as many blocks, each as long: a grid of more blocks than fit at once (many
//    short requests) takes one wave instead of two, and pays each block's start and end once.
//  * the fused kernel (kFusedWarps, up to 16 rows at hd64 / hd128): one block of 16 or 12 warps per
//    SM serves 1-8 kv heads; warp w streams head w % heads, holds that head's rows only, and takes
//    every warps_per_head-th 32-token step of it.  One block per SM instead of four: no blocks that
//    end one after another, no partial wave (Config, below).
//  * static kernels: 4 warps; a 4-stage cp.async pipeline brings 64 tokens (K and V data + block
//    scales) per stage into shared memory; page indices are prefetched one loop iteration ahead.  The
//    one-row-warp kernels of hd64 and hd128 (up to 8 query rows with one row tile: plain decode; up to
//    16 with two) take two stages per iteration, one softmax step for a warp's 16-token sub-tiles of both.
//  * tensor cores: S^T = K Q^T (tokens on the 16-row side, query rows on the 8-wide side) and
//    O^T = V^T P^T, both mma.sync m16n8k16 fp16 with fp32 accumulation (SM80..SM120), for fp16
//    and bf16 queries alike.  The S^T accumulator is turned into the P^T operand with
//    movmatrix.trans, no shared memory.
//  * dequantization in registers: each E2M1 code becomes an fp16 high byte (value * 2^-14, exact,
//    subnormal for codes 0 and 0.5), then one packed multiply by (block scale * 2^7) gives
//    value * scale * 2^-7 EXACTLY (at most 6 significant bits, 2^-17 .. 21).  The 2^7 and
//    the global scales fold into the fp32 softmax scale and output scale.
//  * the MMA K-dimension (head dim for QK, tokens for PV) may be permuted freely as long as both
//    operands agree; the permutations below make every shared-memory read a single 4/8/16-byte
//    load and every unpack a few LOP/PRMT/shift instructions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include "decode_config.cuh"
#include "decode_merge.cuh"
#include "decode_primitives.cuh"
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps, bool kRowCopies>
__global__ void __launch_bounds__((Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>::kThreads),
                                  (Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>::kMinBlocksPerSm))
paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>;
  static_assert(!kRowCopies || C::kRowCopiesServe, "row copies: kernels of one row warp");
  extern __shared__ __align__(16) uint8_t smem[];

  const int split = blockIdx.x, req = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;  // MMA group id / thread-in-group
  const int row_warp = warp / C::kTokenWarps, token_warp = warp % C::kTokenWarps;
  // the block's kv heads (static kernels: heads_per_block > 1 only with one row warp and q_len 1, the
  // binding checks): token warp w streams head w >> warp_head_shift, whose tiles are tokens_per_tile =
  // 64 >> head_shift long; its 16 tokens of each are sub-tile (w & sub_mask).  (The fused kernel: below)
  const int head_shift = p.heads_per_block_log2;
  const int kv_base = blockIdx.y << head_shift;
  const int heads_here = min(1 << head_shift, p.num_kv_heads - kv_base);
  const int tile_shift = 6 - head_shift, warp_head_shift = 2 - head_shift, sub_mask = (4 >> head_shift) - 1;
  // query row r: token r / row_group of the request, q head kv_base * group + r % row_group (with
  // several heads q_len is 1, so the rows are the heads' q heads in order)
  const int row_group = p.group_size << head_shift;
  // the fused kernel: warp w streams head w % heads (so a head's warps spread over the warp
  // schedulers alike), the warp_rank-th of its warps_per_head
  const int warp_head = warp & ((1 << head_shift) - 1), warp_rank = warp >> head_shift;
  const int warps_per_head = C::kWarps >> head_shift;

  // the request's three loads go out together (the early return for an empty request comes after
  // the query loads: before them, nvcc sank the sequence length's load below it, a second memory
  // latency before the first copies)
  const int q_start = p.query_start_loc[req];
  const int q_len = p.query_start_loc[req + 1] - q_start;
  const int seq_len = p.seq_lens[req];
  // max_rows bounds the partial-output rows per kv head; the host sizes it from max_query_len
  const int head_rows = min(q_len * p.group_size, p.max_rows);  // <= 0 for an empty request: no query loads
  const int rows = head_rows * heads_here;
  // the fused kernel's warps hold their own head's rows (block rows warp_row_base ..+ head_rows), and
  // a head's row r is query token r / group_size, q head r % group_size of the kv head; the static
  // kernel's warps hold all the block's rows, row r the token r / row_group (several heads: q_len 1)
  const int warp_row_base = C::kFused ? warp_head * head_rows : 0;
  auto row_token = [&](int row) { return C::kFused ? row % head_rows / p.group_size : row / row_group; };
  auto row_q_head = [&](int row) {
    return C::kFused ? (kv_base + row / head_rows) * p.group_size + row % head_rows % p.group_size
                     : kv_base * p.group_size + row % row_group;
  };
  // query row -> the element offset of its (token, q head) in q or out, given their strides
  auto row_offset = [&](int row, int64_t stride_token, int64_t stride_head) {
    return (int64_t)(q_start + row_token(row)) * stride_token + (int64_t)row_q_head(row) * stride_head;
  };

  // ---------------- Q^T operands: row n of row-tile t is query row (row_warp, t, n); k-step s, slot
  // half holds elements e and e + 4 (q_element).  The raw query bits load first and are combined
  // into operands only after the first copies go out: issued after the copies, they waited behind
  // that burst (16 % of the warp-stall samples at 82 x 512), and consumed before them, they held the
  // copies back (12 % at 82 x 128).  KV mode "hadamard" takes the operands from its rotated rows instead.
  // A thread's elements of a row are the D/4 from c * D/4, so they load as D/32 16-byte pieces (the
  // binding requires 16-byte aligned rows); loaded as 2-byte elements (32 loads per row tile at hd128)
  // they had queued behind each other at the kernel's start (12 % of the warp-stall samples at 128 x 512).
  auto q_element = [&](int s, int half) { return c * (kHeadDim / 4) + 8 * (s >> 1) + pair_element((s & 1) * 2 + half); };
  constexpr int kQPieces = kHeadDim / 32;  // piece m: elements 8m .. 8m + 7 of the thread's D/4, k-steps 2m, 2m + 1
  uint4 q_raw[kRowTiles][kQPieces] = {};  // zeros in KV mode "hadamard", whose operands come from q_rot
  if (!p.hadamard) {
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      const int row = C::kFused ? warp_row_base + t * 8 + g : (row_warp * kRowTiles + t) * 8 + g;
      const bool live = C::kFused ? t * 8 + g < head_rows && warp_head < heads_here : row < rows;
      // row_offset only for a live row: it divides by head_rows, which is 0 for an empty request.  The
      // static kernels' form spelled out: row_offset compiles to a different prologue there, not measured
      const uint4* qrow = reinterpret_cast<const uint4*>(
          C::kFused ? static_cast<const T*>(p.q) + (live ? row_offset(row, p.q_stride_token, p.q_stride_head) : 0) + c * (kHeadDim / 4)
                    : static_cast<const T*>(p.q) + (int64_t)(q_start + (live ? row / row_group : 0)) * p.q_stride_token +
                          (int64_t)(kv_base * p.group_size + (live ? row % row_group : 0)) * p.q_stride_head + c * (kHeadDim / 4));
#pragma unroll
      for (int m = 0; m < kQPieces; ++m) q_raw[t][m] = live ? load_in_order(qrow + m) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  if (q_len <= 0) return;
  // positions visible to the first query row bound the range every row may need
  int kv_begin = 0;
  if (p.sliding_window > 0) kv_begin = max(0, seq_len - q_len - p.sliding_window + 1);
  const int kv_len = max(seq_len - kv_begin, 0);
  const int split_len = (kv_len + p.num_splits - 1) / p.num_splits;
  const int begin = kv_begin + split * split_len;
  const int end = min(begin + split_len, seq_len);
  const int num_tiles = end > begin ? (end - begin + (C::kTileTokens >> head_shift) - 1) >> tile_shift : 0;

  // scores in log2 units: exp2(s * qk_scale_log2) == exp(s * softmax_scale * k_global * 2^7)
  const float qk_scale = p.softmax_scale * __ldg(p.k_global_scale) * kDequantBias;
  const float qk_scale_log2 = qk_scale * kLog2e;
  const bool soft_cap = p.logits_soft_cap > 0.f;
  // every query row sees every position up to first_qpos (the first row's own position)
  const int first_qpos = seq_len - q_len;

  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(smem + C::kLutOffset);

  // ---------------- pipeline: thread -> (token, half) of each stage; the token is one of its warp's
  // 16 of the stage, which are tokens (w & sub_mask) * 16 .. + 15 of head w >> warp_head_shift's part
  // (the fused kernel: of its head's current step, chunk_pos)
  const int load_token = threadIdx.x >> 1, load_half = threadIdx.x & 1;
  const int load_warp = load_token >> 4, load_head = C::kFused ? warp_head : load_warp >> warp_head_shift;
  const bool load_live = load_head < heads_here;  // a block's last kv heads may be fewer
  const int load_kv_head = kv_base + (load_live ? load_head : 0);
  // the loop-invariant parts of the copies are opaque(): held in registers, where nvcc would
  // otherwise recompute them from the parameters and the thread index for every tile (some 50
  // instructions per tile)
  const uint32_t page_mask = opaque(static_cast<uint32_t>((1 << p.page_size_log2) - 1));
  const int* table = opaque(p.block_table + (int64_t)req * p.block_table_stride);
  const int load_pos = static_cast<int>(  // at tile 0
      opaque(static_cast<uint32_t>(begin + (C::kFused ? 0 : (load_warp & sub_mask) * 16) + (load_token & 15))));
  const int load_end = load_live ? end : begin;  // nothing to copy for a head the block lacks
  auto pos_of = [&](int tile) { return load_pos + (tile << tile_shift); };  // this thread's token of a tile
  // the fused kernel's step `chunk` of a head: tokens begin + 32 chunk .. + 31, 16 per stage
  auto chunk_pos = [&](int chunk, int u) { return load_pos + (chunk << 5) + (u << 4); };
  auto page_at = [&](int pos) -> int { return pos < load_end ? __ldg(table + (pos >> p.page_size_log2)) : -1; };
  auto page_of = [&](int tile) -> int {
    const int pos = pos_of(tile);  // pos < load_end implies tile < num_tiles (load_pos >= begin)
    return pos < load_end ? __ldg(table + (pos >> p.page_size_log2)) : -1;
  };
  // the fused kernel: a warp's steps (32 tokens of its head each) are its head's warp_rank-th, then
  // every warps_per_head-th
  const int num_chunks = end > begin ? (end - begin + 31) >> 5 : 0;
  const int warp_chunks = load_live ? num_chunks : 0;  // a head the block lacks: no steps
  int chunk_cur = warp_rank, chunk_next = warps_per_head + warp_rank;  // this step's and the next one's
  // the thread's fixed part of each copy: its kv head, its 16 bytes of each 32-byte sector of a token's
  // K and V data, and the K (half 0) or V (half 1) block scales.  The token's two threads copy a
  // sector's two halves in one instruction: with each thread copying a contiguous half of the token
  // instead, every sector was requested from L2 twice, by two instructions.  Page strides and offsets
  // within a page fit 32 bits (the binding checks): the 32 x 32 -> 64-bit multiply-adds of issue_step
  // kRowCopies (token-major caches, see Config::kRowCopiesServe): kRowThreads threads per token, one 16-byte
  // piece each of its row; copy j of a stage is token j * kRowTokens + row_sub of the warp's 16, whose
  // page its owner lane (2 t) holds
  constexpr int kRowThreads = C::kDataBytes / 16, kRowTokens = 32 / kRowThreads;
  const int lane_in_warp = threadIdx.x & 31, row_piece = lane_in_warp % kRowThreads, row_sub = lane_in_warp / kRowThreads;
  const int row_delta = static_cast<int>(opaque(static_cast<uint32_t>(row_sub - (load_token & 15))));  // its token - mine
  const int copy_offset = kRowCopies ? row_piece * 16 : load_half * 16;
  const uint8_t* k_src = opaque(p.k_data + load_kv_head * p.data_strides.head + copy_offset);
  const uint8_t* v_src = opaque(p.v_data + load_kv_head * p.data_strides.head + copy_offset);
  const uint8_t* scale_src =
      opaque((load_half ? p.v_block_scales : p.k_block_scales) + load_kv_head * p.scale_strides.head);
  const uint32_t data_page_stride = static_cast<uint32_t>(p.data_strides.page);
  const uint32_t scale_page_stride = static_cast<uint32_t>(p.scale_strides.page);
  const uint32_t data_token_stride = static_cast<uint32_t>(p.data_strides.token);
  const uint32_t scale_token_stride = static_cast<uint32_t>(p.scale_strides.token);
  const uint32_t data_dst = opaque(smem_addr(smem) + (kRowCopies ? C::data_offset((load_token & ~15) + row_sub)
                                                                  : C::data_offset(load_token)) + copy_offset);
  const uint32_t scale_dst =
      opaque(smem_addr(smem) + 2 * C::kDataStage + load_half * C::kScaleStage + load_token * C::kScaleBytes);
  // tiles past the last one, up to a whole step, are copied as zeros (their pages are -1): the step reads them
  const int step_tiles = (num_tiles + C::kTilesPerStep - 1) / C::kTilesPerStep * C::kTilesPerStep;
  // the copies of one softmax step's tiles (kTilesPerStep consecutive stages), one commit group: the
  // stages' shared offsets differ by constants, and the step's tiles are all copied or none
  // (the fused kernel: the ring's stages first_tile % kStages.., the tokens of its step `chunk`)
  auto issue_step = [&](int first_tile, int chunk, const int* pages) {  // pages: the step's kTilesPerStep page indices
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
  };
  // the first stages' page indices load together (one table latency before the first copies, not
  // a chain of them); later ones load one loop iteration ahead of their copies
  int first_pages[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s)
    first_pages[s] = C::kFused ? page_at(chunk_pos(s < 2 ? chunk_cur : chunk_next, s & 1)) : page_of(s);
  int next_page[C::kTilesPerStep];
#pragma unroll
  for (int u = 0; u < C::kTilesPerStep; ++u) next_page[u] = first_pages[kStages - C::kTilesPerStep + u];
  auto issue_prologue = [&] {
#pragma unroll
    for (int s = 0; s < kStages - C::kTilesPerStep; s += C::kTilesPerStep)
      issue_step(s, chunk_cur, &first_pages[s]);  // (the fused kernel's one step: kStages 4)
  };
  // the copies go out before the scale table and the query operands are built, which they then
  // overlap; in KV mode "hadamard" the pipeline buffers first hold the rotated query rows
  if (!p.hadamard) issue_prologue();
  for (int i = threadIdx.x; i < 256; i += C::kThreads) scale_lut[i] = scale2(e4m3_value(i));  // read after the barrier before the tile loop

  // ---------------- KV mode "hadamard": the block's query rows, rotated, in the (still unused)
  // pipeline buffers as fp32 (kMaxBlockRows x D x 4 bytes fit); rows past `rows` are zero
  float* q_rot = reinterpret_cast<float*>(smem);
  if (p.hadamard) {
    for (int idx = threadIdx.x; idx < C::kMaxBlockRows * kHeadDim; idx += C::kThreads) {
      const int row = idx / kHeadDim, d = idx % kHeadDim;
      q_rot[idx] = row < rows ? to_float(static_cast<const T*>(p.q)[row_offset(row, p.q_stride_token, p.q_stride_head) + d])
                              : 0.f;
    }
    fwht_rows<kHeadDim, C::kThreads>(q_rot, rows);  // rows past `rows` stay zero
  }

  // ---------------- the Q^T operands, now that the first copies are out; the cache positions of the rows
  uint32_t q_frag[kRowTiles][C::kKSteps][2];
  int row_pos[kRowTiles][2];        // cache position of query rows 2c, 2c+1 (or -1: no such row)
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const float* rotated = q_rot + (C::kFused ? warp_row_base + t * 8 + g : (row_warp * kRowTiles + t) * 8 + g) * kHeadDim;
#pragma unroll
    for (int s = 0; s < C::kKSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int e = q_element(s, half);
        // piece s / 2 holds elements {e0 e1, e2 e3, e4 e5, e6 e7}; slot half of k-step s is (e_j, e_j+4),
        // j = pair_element(2 (s % 2) + half): low halves of words (half, half + 2) for even s, high for odd
        const uint4 piece = q_raw[t][s >> 1];
        const uint32_t q_pair = __byte_perm(half ? piece.y : piece.x, half ? piece.w : piece.z, s & 1 ? 0x7632 : 0x5410);
        q_frag[t][s][half] = p.hadamard ? pack2(rotated[e] * p.hadamard_scale, rotated[e + 4] * p.hadamard_scale, T())
                                        : q_pair;
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (C::kFused ? warp_row_base + t * 8 : (row_warp * kRowTiles + t) * 8) + 2 * c + i;
      const bool live = C::kFused ? t * 8 + 2 * c + i < head_rows : r < rows;
      row_pos[t][i] = live ? seq_len - q_len + row_token(r) : -1;
    }
  }

  if (p.hadamard) {
    __syncthreads();  // q_rot is read; the pipeline may overwrite it
    issue_prologue();
  }

  // ---------------- running softmax state of this thread's rows (2c, 2c+1 of each row tile)
  float o_acc[kRowTiles][C::kDTiles][4];
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) row_max[t][i] = -INFINITY, row_sum[t][i] = 0.f;
#pragma unroll
    for (int d = 0; d < C::kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[t][d][i] = 0.f;
  }

  // bf16 rows move into fp16 times 2^row_exp, which puts the row's largest magnitude in
  // [2^14, 2^15) (maxima below 2^-113 take 2^127 and end lower, still exact); the softmax
  // divides it out
  float score_scale[kRowTiles][2];  // rows 2c, 2c+1: (soft-cap ? qk_scale : qk_scale_log2) * 2^-row_exp
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    int row_exp = 0;
    if constexpr (!std::is_same_v<T, __half>) {
      float amax = 0.f;  // a NaN element drops out here and stays NaN in its fragment
#pragma unroll
      for (int s = 0; s < C::kKSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 v = to_float2(q_frag[t][s][half], T());
          amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
        }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the row's 4 lanes
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      // from 2^-114 (an infinite maximum) to 2^127 (zero rows, and maxima below 2^-113)
      row_exp = min(141 - static_cast<int>(__float_as_uint(amax) >> 23), 127);
      const float q_scale = ldexpf(1.f, row_exp);
#pragma unroll
      for (int s = 0; s < C::kKSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 v = to_float2(q_frag[t][s][half], T());
          q_frag[t][s][half] = pack2(v.x * q_scale, v.y * q_scale, __half());
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      score_scale[t][i] = ldexpf(soft_cap ? qk_scale : qk_scale_log2, -__shfl_sync(0xffffffffu, row_exp, (2 * c + i) * 4));
  }
  // the row warp's operands, stored by its first token warp; read after the barrier before the tile loop
  // (the fused kernel: one copy per kv head, stored by the head's first warp)
  uint2* q_smem = reinterpret_cast<uint2*>(smem + C::kQOffset) + (C::kFused ? warp_head : row_warp) * kRowTiles * C::kKSteps * 32;
  if constexpr (C::kQInSmem) {
    if (C::kFused ? warp_rank == 0 : token_warp == 0) {
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t)
#pragma unroll
        for (int s = 0; s < C::kKSteps; ++s) q_smem[(t * C::kKSteps + s) * 32 + lane] = make_uint2(q_frag[t][s][0], q_frag[t][s][1]);
    }
  }

  // this thread's shared-memory offsets within a stage's first 16-token sub-tile; sub-tile k adds
  // k * kSubData / kSubScale (data_offset is linear in steps of 16 rows)
  constexpr int kSubData = C::data_offset(16), kSubScale = 16 * C::kScaleBytes;
  // token kb is ka + 2, in the same padded group of 4 rows: b's offsets are a's plus constants
  const int ka = tile_token(g), kb = ka + 2;
  const int k_off_a = C::data_offset(ka) + c * C::kKChunk, k_off_b = k_off_a + 2 * C::kDataBytes;
  const int ks_off_a = ka * C::kScaleBytes + c * (C::kKChunk / 8), ks_off_b = ks_off_a + 2 * C::kScaleBytes;
  // V: thread c holds tokens 4c..4c+3 (one padded group of 4 rows), head-dim bytes [g*kVChunk, +kVChunk)
  const int v_off = C::data_offset(4 * c) + g * C::kVChunk, vs_off = 4 * c * C::kScaleBytes;

  __syncthreads();  // the scale table (and the Q operands in shared memory) are read by every warp
  // (the fused kernel: `tile` counts the warp's stages, so tile % kStages is still its ring's place)
  for (int tile = 0; C::kFused ? chunk_cur < warp_chunks : tile < num_tiles; tile += C::kTilesPerStep) {
    cp_async_wait<(kStages - 2 * C::kTilesPerStep) / C::kTilesPerStep>();  // a commit group per step
    // With one row warp, a warp reads only the sub-tiles of each stage that its own lanes copy, so a
    // warp barrier orders its copies and its reads, and the warps need not wait for each other every
    // tile.  Row warps share their sub-tiles and need the block's barrier.
    if constexpr (C::kTokenWarps == C::kWarps) __syncwarp();
    else __syncthreads();
    issue_step(tile + kStages - C::kTilesPerStep, chunk_next, next_page);
    const int chunk_after = chunk_next + warps_per_head;  // the fused kernel's step after next: its pages load now
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u)
      next_page[u] = C::kFused ? page_at(chunk_pos(chunk_after, u)) : page_of(tile + kStages + u);
    // the step's sub-tile j: this warp's sub-tile j % kSubTiles of stage tile + j / kSubTiles
    auto stage_of = [&](int j) { return smem + ((tile + j / C::kSubTiles) % kStages) * C::kStageBytes; };
    auto sub_of = [&](int j) { return token_warp + (j % C::kSubTiles) * C::kTokenWarps; };

#pragma unroll
    for (int first = 0; first < C::kStepSubTiles; first += C::kTilesPerStep) {
      constexpr int kJ = C::kTilesPerStep;  // sub-tiles of this softmax step
      // ---- S^T = K Q^T, per sub-tile
      float s_acc[kJ][kRowTiles][4];
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const uint8_t* stage = stage_of(first + j);
        const int sub = sub_of(first + j);
        const uint8_t* k_data = stage + sub * kSubData;
        const uint8_t* k_scales = stage + 2 * C::kDataStage + sub * kSubScale;
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) s_acc[j][t][i] = 0.f;
        uint32_t kwa[C::kKChunk / 4], kwb[C::kKChunk / 4];
#pragma unroll
        for (int w = 0; w < C::kKChunk / 4; w += 2) {
          *reinterpret_cast<uint2*>(&kwa[w]) = *reinterpret_cast<const uint2*>(k_data + k_off_a + 4 * w);
          *reinterpret_cast<uint2*>(&kwb[w]) = *reinterpret_cast<const uint2*>(k_data + k_off_b + 4 * w);
        }
#pragma unroll
        for (int blk = 0; blk < C::kKChunk / 8; ++blk) {  // one E4M3 scale per 8 bytes
          const uint32_t sa = scale_lut[k_scales[ks_off_a + blk]];
          const uint32_t sb = scale_lut[k_scales[ks_off_b + blk]];
#pragma unroll
          for (int w2 = 0; w2 < 2; ++w2) {
            const int w = blk * 2 + w2;
            uint32_t pa[4], pb[4];
            unpack_word(kwa[w], pa);
            unpack_word(kwb[w], pb);
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // two k-steps per word
              const int s = 2 * w + h;
              const uint32_t a[4] = {mul2(pa[2 * h], sa), mul2(pb[2 * h], sb), mul2(pa[2 * h + 1], sa),
                                     mul2(pb[2 * h + 1], sb)};
#pragma unroll
              for (int t = 0; t < kRowTiles; ++t) {
                if constexpr (C::kQInSmem) {
                  const uint2 b = q_smem[(t * C::kKSteps + s) * 32 + lane];
                  mma(s_acc[j][t], a, b.x, b.y);
                } else {
                  mma(s_acc[j][t], a, q_frag[t][s][0], q_frag[t][s][1]);
                }
              }
            }
          }
        }
      }
      // ---- online softmax over the step's sub-tiles.  Masks are needed only where a sub-tile crosses
      // the end of the range or a query row's position, or with a window (the same predicate per
      // element as before; rows past `rows` may then hold scores, but they are never stored).
      int pos0[kJ];
      bool masked[kJ];
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        pos0[j] = C::kFused ? begin + (chunk_cur << 5) + 16 * j
                            : begin + ((tile + (first + j) / C::kSubTiles) << tile_shift) + (sub_of(first + j) & sub_mask) * 16;
        masked[j] = pos0[j] + 15 >= end || pos0[j] + 15 > first_qpos || p.sliding_window > 0;
      }
      uint32_t p_frag[kJ][kRowTiles][2];
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) {
        float x[kJ][4];
#pragma unroll
        for (int j = 0; j < kJ; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) x[j][i] = s_acc[j][t][i] * score_scale[t][i & 1];
        // one uniform branch for the scores: a branch per score (what nvcc made of a test inside
        // the loop) cost four taken jumps per 16 tokens without a cap, each an instruction-fetch stall
        if (soft_cap) {
#pragma unroll
          for (int j = 0; j < kJ; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) x[j][i] = p.logits_soft_cap * tanhf(x[j][i] / p.logits_soft_cap) * kLog2e;
        }
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          if (masked[j]) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int pos = pos0[j] + (i < 2 ? ka : kb);
              const int qpos = row_pos[t][i & 1];
              bool ok = pos < end && pos <= qpos;
              if (p.sliding_window > 0) ok = ok && pos > qpos - p.sliding_window;
              if (!ok) x[j][i] = -INFINITY;
            }
          }
        }
        float m_new[2];
        bool grow = false;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float m = fmaxf(x[0][i], x[0][i + 2]);
#pragma unroll
          for (int j = 1; j < kJ; ++j) m = fmaxf(m, fmaxf(x[j][i], x[j][i + 2]));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          m_new[i] = fmaxf(row_max[t][i], m);
          grow |= m_new[i] != row_max[t][i];
        }
        // rescale only when a row's running maximum grew (else alpha would be exactly 1)
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float alpha = fast_exp2(row_max[t][i] - (m_new[i] == -INFINITY ? 0.f : m_new[i]));
            row_max[t][i] = m_new[i];
            row_sum[t][i] *= alpha;
#pragma unroll
            for (int d = 0; d < C::kDTiles; ++d) {
              o_acc[t][d][i] *= alpha;
              o_acc[t][d][i + 2] *= alpha;
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          float p_val[4];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float base = (row_max[t][i] == -INFINITY ? 0.f : row_max[t][i]) - kWeightBiasLog2;
            p_val[i] = fast_exp2(x[j][i] - base);
            p_val[i + 2] = fast_exp2(x[j][i + 2] - base);
            row_sum[t][i] = row_sum[t][i] + p_val[i] + p_val[i + 2];
          }
          // S^T fragment (tokens x rows) -> P^T operand (k = tokens, n = rows)
          p_frag[j][t][0] = transpose8x8(pack2(p_val[0], p_val[1], __half()));
          p_frag[j][t][1] = transpose8x8(pack2(p_val[2], p_val[3], __half()));
        }
      }
      // ---- O^T += V^T P^T, per sub-tile
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const uint8_t* stage = stage_of(first + j);
        const int sub = sub_of(first + j);
        const uint8_t* v_data = stage + C::kDataStage + sub * kSubData;
        const uint8_t* v_scales = stage + 2 * C::kDataStage + C::kScaleStage + sub * kSubScale;
        uint32_t vw[4][C::kVChunk / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint8_t* src = v_data + v_off + r * C::kDataBytes;
          if constexpr (C::kVChunk == 4) vw[r][0] = *reinterpret_cast<const uint32_t*>(src);
          if constexpr (C::kVChunk == 8) *reinterpret_cast<uint2*>(vw[r]) = *reinterpret_cast<const uint2*>(src);
          if constexpr (C::kVChunk == 16) *reinterpret_cast<uint4*>(vw[r]) = *reinterpret_cast<const uint4*>(src);
        }
#pragma unroll
        for (int w = 0; w < C::kVChunk / 4; ++w) {
          const int sidx = (g * C::kVChunk + 4 * w) / 8;  // 8 bytes per block scale
          uint32_t sv[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) sv[r] = scale_lut[v_scales[vs_off + r * C::kScaleBytes + sidx]];
          // {scale of token 0, of token 1}: the low halves of two {s, s} entries
          const uint32_t s01 = __byte_perm(sv[0], sv[1], 0x5410), s23 = __byte_perm(sv[2], sv[3], 0x5410);
          // interleave two tokens' bytes so each unpacked pair holds one head-dim index of both
          uint32_t p01[8], p23[8];
          unpack_word(__byte_perm(vw[0][w], vw[1][w], 0x5410), *reinterpret_cast<uint32_t(*)[4]>(&p01[0]));
          unpack_word(__byte_perm(vw[0][w], vw[1][w], 0x7632), *reinterpret_cast<uint32_t(*)[4]>(&p01[4]));
          unpack_word(__byte_perm(vw[2][w], vw[3][w], 0x5410), *reinterpret_cast<uint32_t(*)[4]>(&p23[0]));
          unpack_word(__byte_perm(vw[2][w], vw[3][w], 0x7632), *reinterpret_cast<uint32_t(*)[4]>(&p23[4]));
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // 8 pairs -> 4 m-tiles of this word (2 head-dim rows each)
            const int d = w * 4 + q;
            const uint32_t a[4] = {mul2(p01[2 * q], s01), mul2(p01[2 * q + 1], s01), mul2(p23[2 * q], s23),
                                   mul2(p23[2 * q + 1], s23)};
#pragma unroll
            for (int t = 0; t < kRowTiles; ++t) mma(o_acc[t][d], a, p_frag[j][t][0], p_frag[j][t][1]);
          }
        }
      }
    }
    if constexpr (C::kFused) chunk_cur = chunk_next, chunk_next = chunk_after;
  }
  // the output scale's load goes out before the epilogue's barriers: loaded after them (where it is
  // used), its latency stalled every block of a one-wave grid at once
  const float v_scale = load_in_order(p.v_global_scale) * kDequantBias;
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the merge buffers

  // ---------------- finish this warp's rows: full row sums, then merge the token warps
  float* merge_out = reinterpret_cast<float*>(smem);                      // [warps][rows][D]
  float* merge_ml = merge_out + C::kTokenWarps * C::kMaxRows * kHeadDim;  // [warps][rows][2]
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = row_sum[t][i];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      const int row = (row_warp * kRowTiles + t) * 8 + 2 * c + i;
      float* out_row = merge_out + (token_warp * C::kMaxRows + row) * kHeadDim;
#pragma unroll
      for (int d = 0; d < C::kDTiles; ++d) {
        // m-tile d = word d/4, pair (d%4): rows g and g+8 are elements pair_element(2q), +4 ...
        const int w = d / 4, q = d % 4;
        const int base = g * (kHeadDim / 8) + 8 * w;
        const int e0 = (2 * q) < 4 ? pair_element(2 * q) : pair_element(2 * q - 4) + 4;
        const int e1 = (2 * q + 1) < 4 ? pair_element(2 * q + 1) : pair_element(2 * q + 1 - 4) + 4;
        out_row[base + e0] = o_acc[t][d][i];
        out_row[base + e1] = o_acc[t][d][i + 2];
      }
      if (g == 0) {
        merge_ml[(token_warp * C::kMaxRows + row) * 2 + 0] = row_max[t][i];
        merge_ml[(token_warp * C::kMaxRows + row) * 2 + 1] = l;
      }
    }
  }
  __syncthreads();

  // Each thread then finishes 8 consecutive elements of a row at a time (one 16-byte store, two for
  // fp32 partials), from the token warps that streamed the row's kv head (all of them unless the block
  // packs heads; the others computed it against another head's keys, so they must not enter it, not
  // even times 0: NaN * 0).  Every thread derives its row's weights itself: a pass of one warp over
  // the rows, between two barriers, had kept the other warps waiting, and an element per thread and
  // pass cost 8 passes of shared loads and 2-byte stores at hd128 (together 17 % of the warp-stall
  // samples at 128 x 512).
  constexpr int kPieces = kHeadDim / 8;  // a row's 8-element pieces
  auto partial_row = [&](int row, int head) {  // the row's partial row index (split-KV)
    const int64_t part = ((int64_t)req * p.num_kv_heads + kv_base + head) * p.num_splits + split;
    return part * p.max_rows + row - head * head_rows;
  };
  float* rot_rows = reinterpret_cast<float*>(smem + C::kRotOffset);  // KV mode "hadamard": [rows][D]
  for (int idx = threadIdx.x; idx < rows * kPieces; idx += C::kThreads) {
    const int row = idx / kPieces, d0 = idx % kPieces * 8;
    const int head = row / head_rows;  // of the block's heads
    // the row in its warps' merge slots: the fused kernel's warps hold their head's rows only
    const int slot = C::kFused ? row - head * head_rows : row;
    auto live = [&](int w) { return (C::kFused ? w & ((1 << head_shift) - 1) : w >> warp_head_shift) == head; };
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kTokenWarps; ++w)
      if (live(w)) m = fmaxf(m, merge_ml[(w * C::kMaxRows + slot) * 2]);
    const float base = m == -INFINITY ? 0.f : m;
    float l = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < C::kTokenWarps; ++w) {
      if (!live(w)) continue;
      const float f = exp2f(merge_ml[(w * C::kMaxRows + slot) * 2] - base);
      l += f * merge_ml[(w * C::kMaxRows + slot) * 2 + 1];
      const float4* src = reinterpret_cast<const float4*>(merge_out + (w * C::kMaxRows + slot) * kHeadDim + d0);
      const float4 lo = src[0], hi = src[1];
      o[0] += f * lo.x, o[1] += f * lo.y, o[2] += f * lo.z, o[3] += f * lo.w;
      o[4] += f * hi.x, o[5] += f * hi.y, o[6] += f * hi.z, o[7] += f * hi.w;
    }
    const int64_t part_row = p.num_splits > 1 ? partial_row(row, head) : 0;
    if (p.num_splits > 1) {  // the partial rows stay unnormalized
      if (d0 == 0) p.partial_max[part_row] = m, p.partial_sum[part_row] = l;
    } else {
      if (p.sinks != nullptr) {
        const float sink = __ldg(p.sinks + row_q_head(row)) * kLog2e;
        const float m2 = fmaxf(m, sink);
        const float f = exp2f(m == -INFINITY ? -INFINITY : m - m2);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] *= f;
        l = l * f + exp2f(sink - m2 + kWeightBiasLog2);
      }
      // l == 0: no visible key and no sink -> 0; a NaN l (a NaN score) must stay NaN, so no "l > 0"
      const float norm = v_scale / l;
#pragma unroll
      for (int k = 0; k < 8; ++k) o[k] = l == 0.f ? 0.f : o[k] * norm;
    }
    // two float4 stores: d0 is a multiple of 8, and the rows of merge_out and partial_out start 16-byte
    // aligned (the binding checks the workspace's alignment)
    auto store8 = [&](float* dst) {
      reinterpret_cast<float4*>(dst)[0] = make_float4(o[0], o[1], o[2], o[3]);
      reinterpret_cast<float4*>(dst)[1] = make_float4(o[4], o[5], o[6], o[7]);
    };
    if (p.hadamard) {  // rotated back below (the merge is linear in the rows); in the static kernel
      // rot_rows is token warp 0's slot, whose these elements this thread alone read
      store8(rot_rows + row * kHeadDim + d0);
    } else if (p.num_splits > 1) {
      store8(p.partial_out + part_row * kHeadDim + d0);
    } else {
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_offset(row, p.out_stride_token, p.out_stride_head) + d0) =
          make_uint4(pack2(o[0], o[1], T()), pack2(o[2], o[3], T()), pack2(o[4], o[5], T()), pack2(o[6], o[7], T()));
    }
  }
  if (p.hadamard) {  // rotate the rows back: (P V H) H = P V
    fwht_rows<kHeadDim, C::kThreads>(rot_rows, rows);
    for (int idx = threadIdx.x; idx < rows * kHeadDim; idx += C::kThreads) {
      const int row = idx / kHeadDim, d = idx % kHeadDim;
      const float value = rot_rows[row * kHeadDim + d] * p.hadamard_scale;
      if (p.num_splits > 1) {
        p.partial_out[partial_row(row, row / head_rows) * kHeadDim + d] = value;
      } else {
        store(static_cast<T*>(p.out) + row_offset(row, p.out_stride_token, p.out_stride_head) + d, value);
      }
    }
  }
}

template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps = 0>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  using C = Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>;
  auto kernel = paged_decode_kernel<T, kHeadDim, kRowTiles, kRowWarps, kFusedWarps, false>;
  if constexpr (C::kRowCopiesServe) {
    if (p.data_strides.head == C::kDataBytes) kernel = paged_decode_kernel<T, kHeadDim, kRowTiles, kRowWarps, kFusedWarps, true>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_splits, (p.num_kv_heads + (1 << p.heads_per_block_log2) - 1) >> p.heads_per_block_log2, p.batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess || p.num_splits == 1) return err;
  merge_splits_kernel<T, kHeadDim>
      <<<dim3(p.max_rows, p.num_kv_heads, p.batch), merge_threads<kHeadDim>(p.num_splits), 0, stream>>>(p);
  return cudaGetLastError();
}

// The fused kernel, where the device gives a block its shared memory (at D 128 some 145 KB for 16
// warps and 147 KB for 12: sm_80 and sm_90 do, sm_86, sm_89 and sm_120 give 99 KB).  Elsewhere the
// same plan runs on the kernel of one row warp, one kv head per block: the splits and their
// workspace are per kv head either way.
template <typename T, int kHeadDim, int kRowTiles>
cudaError_t launch_fused(const DecodeParams& p, cudaStream_t stream) {
  constexpr int kFusedWarps = kRowTiles == 1 ? 16 : 12;  // decode_fused_warps
  int device = 0, smem_per_block = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (smem_per_block >= Config<kHeadDim, kRowTiles, 1, kFusedWarps>::kSmemBytes)
    return launch<T, kHeadDim, kRowTiles, 1, kFusedWarps>(p, stream);
  DecodeParams one_head = p;
  one_head.fused_warps = 0;
  one_head.heads_per_block_log2 = 0;
  return launch<T, kHeadDim, kRowTiles, 1>(one_head, stream);
}

// Row capacity configurations: (row tiles per warp, row warps); the first that fits max_rows.
template <typename T, int kHeadDim>
cudaError_t launch_for_rows(const DecodeParams& p, cudaStream_t stream) {
  if (p.fused_warps != 0) {  // decode_fused_ok: D <= 128, up to 16 rows
    if constexpr (kHeadDim <= 128) return p.max_rows <= 8 ? launch_fused<T, kHeadDim, 1>(p, stream)
                                                          : launch_fused<T, kHeadDim, 2>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (p.max_rows <= 8) return launch<T, kHeadDim, 1, 1>(p, stream);
  if constexpr (kHeadDim <= 128) {
    if (p.max_rows <= 16) return launch<T, kHeadDim, 2, 1>(p, stream);
    if (p.max_rows <= 32) return launch<T, kHeadDim, 2, 2>(p, stream);
    if (p.max_rows <= 64) return launch<T, kHeadDim, 2, 4>(p, stream);
  } else {
    if (p.max_rows <= 16) return launch<T, kHeadDim, 1, 2>(p, stream);
    if (p.max_rows <= 32) return launch<T, kHeadDim, 1, 4>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace decode
}  // namespace nvfp4
