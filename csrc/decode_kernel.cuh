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
//    end one after another, no partial wave (Config in decode_config.cuh).
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
//    operands agree; the permutations (tile_token, q_element, unpack_word's pair order) make every
//    shared-memory read a single 4/8/16-byte load and every unpack a few LOP/PRMT/shift instructions.
//
// The two kernels below are the same steps (decode_*.cuh), in the order they run: the block's rows
// (decode_rows.cuh), the query loads (decode_query.cuh), the copies' pipeline (decode_copy.cuh), one
// softmax step per loop iteration (decode_tile.cuh), and the epilogue (decode_epilogue.cuh).  They
// differ in which tokens a warp streams: the static kernels' warps share every 64-token tile, the
// fused kernel's warps take their own head's 32-token steps.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "decode_config.cuh"
#include "decode_copy.cuh"
#include "decode_epilogue.cuh"
#include "decode_merge.cuh"
#include "decode_primitives.cuh"
#include "decode_query.cuh"
#include "decode_rows.cuh"
#include "decode_tile.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// The static kernels: 4 warps; each loop iteration reads this warp's sub-tiles of Config::kTilesPerStep
// consecutive 64-token tiles (of each packed head's 64 >> head_shift tokens of them), one softmax step
// per kTilesPerStep sub-tiles.
template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, bool kRowCopies>
__global__ void __launch_bounds__((Config<kHeadDim, kRowTiles, kRowWarps>::kThreads),
                                  (Config<kHeadDim, kRowTiles, kRowWarps>::kMinBlocksPerSm))
paged_decode_static_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<kHeadDim, kRowTiles, kRowWarps>;
  extern __shared__ __align__(16) uint8_t smem[];
  const StaticRows<C> b(p);
  QueryPieces<C> pieces = {};  // zeros in KV mode "hadamard", whose operands come from the rotated rows
  load_query_pieces<C, T>(pieces, p, b);
  if (b.q_len <= 0) return;
  const KvSplit kv(p, b);
  const int num_tiles = kv.end > kv.begin ? (kv.end - kv.begin + (C::kTileTokens >> b.head_shift) - 1) >> b.tile_shift : 0;
  const ScoreScale sc(p);
  const StepCopies<C, kRowCopies> copies(p, b, smem, kv);
  const int step_tiles = (num_tiles + C::kTilesPerStep - 1) / C::kTilesPerStep * C::kTilesPerStep;
  StepPages<C> pages([&](int s) { return copies.tile_page(s); });
  QueryOperands<C> q;
  prepare_queries<C, T>(q, p, b, pieces, sc, smem, [&] {
#pragma unroll
    for (int s = 0; s < kStages - C::kTilesPerStep; s += C::kTilesPerStep) copies.issue_tiles(s, step_tiles, &pages.first[s]);
  });
  RowState<C> state;
  const TileReader<C> reader(b, smem);
  __syncthreads();  // the scale table (and the Q operands in shared memory) are read by every warp

  for (int tile = 0; tile < num_tiles; tile += C::kTilesPerStep) {
    wait_for_step<C>();
    copies.issue_tiles(tile + kStages - C::kTilesPerStep, step_tiles, pages.next);
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u) pages.next[u] = copies.tile_page(tile + kStages + u);
#pragma unroll
    for (int first = 0; first < C::kStepSubTiles; first += C::kTilesPerStep) {
      attend_step<C>(state, reader, q, p, sc, kv, tile, first, [&](int j) {  // sub-tile j's first position
        return kv.begin + ((tile + (first + j) / C::kSubTiles) << b.tile_shift) + (reader.sub(first + j) & b.sub_mask) * 16;
      });
    }
  }
  epilogue<C, T>(p, b, smem, state);
}

// The fused kernel: kFusedWarps warps per block, one block per SM.  Warp w streams kv head w % heads
// and takes its head's 32-token steps warp_rank, warp_rank + warps_per_head, ... (chunks): two stages of
// its own per step; `tile` counts the warp's stages, so tile % kStages is still its ring's place.
template <typename T, int kHeadDim, int kRowTiles, int kFusedWarps, bool kRowCopies>
__global__ void __launch_bounds__((Config<kHeadDim, kRowTiles, 1, kFusedWarps>::kThreads),
                                  (Config<kHeadDim, kRowTiles, 1, kFusedWarps>::kMinBlocksPerSm))
paged_decode_fused_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<kHeadDim, kRowTiles, 1, kFusedWarps>;
  static_assert(kStages == 2 * C::kTilesPerStep, "the prologue is one step");
  extern __shared__ __align__(16) uint8_t smem[];
  const FusedRows<C> b(p);
  QueryPieces<C> pieces = {};
  load_query_pieces<C, T>(pieces, p, b);
  if (b.q_len <= 0) return;
  const KvSplit kv(p, b);
  const ScoreScale sc(p);
  const StepCopies<C, kRowCopies> copies(p, b, smem, kv);
  const int num_chunks = kv.end > kv.begin ? (kv.end - kv.begin + 31) >> 5 : 0;
  const int warp_chunks = copies.live ? num_chunks : 0;  // a head the block lacks: no steps
  int chunk_cur = b.warp_rank, chunk_next = b.warps_per_head + b.warp_rank;  // this step's and the next one's
  StepPages<C> pages([&](int s) { return copies.page(copies.chunk_pos(s < 2 ? chunk_cur : chunk_next, s & 1)); });
  QueryOperands<C> q;
  prepare_queries<C, T>(q, p, b, pieces, sc, smem, [&] { copies.issue_chunk(0, chunk_cur, warp_chunks, pages.first); });
  RowState<C> state;
  const TileReader<C> reader(b, smem);
  __syncthreads();  // the scale table (and the Q operands in shared memory) are read by every warp

  for (int tile = 0; chunk_cur < warp_chunks; tile += C::kTilesPerStep) {
    wait_for_step<C>();
    copies.issue_chunk(tile + kStages - C::kTilesPerStep, chunk_next, warp_chunks, pages.next);
    const int chunk_after = chunk_next + b.warps_per_head;  // the step after next: its pages load now
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u) pages.next[u] = copies.page(copies.chunk_pos(chunk_after, u));
    attend_step<C>(state, reader, q, p, sc, kv, tile, 0, [&](int j) { return kv.begin + (chunk_cur << 5) + 16 * j; });
    chunk_cur = chunk_next, chunk_next = chunk_after;
  }
  epilogue<C, T>(p, b, smem, state);
}

// The kernel of a configuration: the fused one where kFusedWarps > 0.
template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps, bool kRowCopies>
constexpr auto kernel_of() {
  if constexpr (kFusedWarps > 0) return paged_decode_fused_kernel<T, kHeadDim, kRowTiles, kFusedWarps, kRowCopies>;
  else return paged_decode_static_kernel<T, kHeadDim, kRowTiles, kRowWarps, kRowCopies>;
}

template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps = 0>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  using C = Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>;
  auto kernel = kernel_of<T, kHeadDim, kRowTiles, kRowWarps, kFusedWarps, false>();
  if constexpr (C::kRowCopiesServe) {
    if (p.data_strides.head == C::kDataBytes) kernel = kernel_of<T, kHeadDim, kRowTiles, kRowWarps, kFusedWarps, true>();
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
