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
// The kernel is its steps (docs/kernels.md#decode-steps): the queries (decode_query.cuh), the copies
// (decode_copy.cuh), one softmax step per loop iteration (decode_tile.cuh), the epilogue
// (decode_epilogue.cuh).
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
#include "decode_tile.cuh"
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// The kernel, as the steps of decode_query.cuh, decode_copy.cuh, decode_tile.cuh and
// decode_epilogue.cuh in the order they run.  The thread's and the block's scalars stay the kernel's
// locals, handed to the steps as values, and the arrays the steps fill are the kernel's: with either
// moved into the steps, nvcc placed, folded or numbered them otherwise and ptxas allocated other
// registers (docs/kernels.md#decode-steps).
template <typename T, int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps, bool kRowCopies>
__global__ void __launch_bounds__((Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>::kThreads),
                                  (Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>::kMinBlocksPerSm))
paged_decode_kernel(const __grid_constant__ DecodeParams p) {
  using C = Config<kHeadDim, kRowTiles, kRowWarps, kFusedWarps>;
  static_assert(!kRowCopies || C::kRowCopiesServe, "row copies: kernels of one row warp");
  extern __shared__ __align__(16) uint8_t smem[];

  // ---------------- where the block and the thread are (Config says how the kernels share the work)
  const int split = blockIdx.x, req = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;  // MMA group id / thread-in-group
  const int row_warp = warp / C::kTokenWarps, token_warp = warp % C::kTokenWarps;
  // the block's kv heads (static kernels: heads_per_block > 1 only with one row warp and q_len 1, the
  // binding checks): token warp w streams head w >> warp_head_shift, whose tiles are tokens_per_tile =
  // 64 >> head_shift long; its 16 tokens of each are sub-tile (w & sub_mask)
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
  // the request's three loads go out together (the early return for an empty request comes after the
  // query loads: before them, nvcc sank the sequence length's load below it, a second memory latency
  // before the first copies)
  const int q_start = p.query_start_loc[req];
  const int q_len = p.query_start_loc[req + 1] - q_start;
  const int seq_len = p.seq_lens[req];
  // max_rows bounds the rows per kv head (the host sizes it from the call's decode query length): a
  // longer request is the prefill kernel's or the dense path's (extend.py), which write all its rows,
  // so a block here would only read its KV for rows that are overwritten, and race with them where the
  // two run side by side
  const int request_rows = q_len * p.group_size;
  const int head_rows = request_rows <= p.max_rows ? request_rows : 0;  // <= 0: no query loads
  const int rows = head_rows * heads_here;
  // the fused kernel's warps hold their own head's rows: block rows warp_row_base ..+ head_rows
  const int warp_row_base = C::kFused ? warp_head * head_rows : 0;
  const Rows<C> rows_of{p, head_rows, row_group, kv_base, q_start};

  // ---------------- step 1: the queries' raw bits (the operands come after the first copies)
  auto q_element = [&](int s, int half) { return c * (kHeadDim / 4) + 8 * (s >> 1) + pair_element((s & 1) * 2 + half); };
  uint4 q_raw[kRowTiles][C::kQPieces] = {};  // zeros in KV mode "hadamard", whose operands come from q_rot
  load_queries<C, T>(q_raw, p, rows_of, warp_row_base, row_warp, g, c, head_rows, warp_head, heads_here, rows, q_start, row_group,
                     kv_base);
  if (head_rows <= 0) return;

  // ---------------- the split's positions [begin, end): those visible to the first query row bound
  // the range every row may need, and the splits share it
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
  const int first_qpos = seq_len - q_len;  // every query row sees every position up to it
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(smem + C::kLutOffset);  // filled below, read after the barrier

  // ---------------- step 2: the pipeline's first copies (the fused kernel: a warp's steps, 32 tokens
  // of its head each, are its head's warp_rank-th, then every warps_per_head-th)
  Copies<C, kRowCopies> copies;
  plan_copies<C, kRowCopies>(copies, p, smem, req, kv_base, heads_here, warp_head, warp_head_shift, sub_mask, tile_shift, begin, end,
                             num_tiles, threadIdx.x);
  int chunk_cur = warp_rank, chunk_next = warps_per_head + warp_rank;  // this step's and the next one's
  int first_pages[kStages];
  int next_page[C::kTilesPerStep];
  copies.first_pages(first_pages, next_page, chunk_cur, chunk_next);
  // the copies go out before the scale table and the query operands are built, which they then
  // overlap; in KV mode "hadamard" the pipeline buffers first hold the rotated query rows
  if (!p.hadamard) copies.issue_prologue(chunk_cur, first_pages);
  for (int i = threadIdx.x; i < 256; i += C::kThreads) scale_lut[i] = scale2(e4m3_value(i));

  // ---------------- step 1, continued: the Q^T operands and the rows' cache positions
  rotate_queries<C, T>(p, smem, rows, rows_of);
  uint32_t q_frag[kRowTiles][C::kKSteps][2];
  int row_pos[kRowTiles][2];
  query_operands<C, T>(q_frag, row_pos, q_raw, p, reinterpret_cast<const float*>(smem), q_element, rows_of, warp_row_base, row_warp,
                       g, c, head_rows, rows, seq_len, q_len);
  if (p.hadamard) {
    __syncthreads();  // q_rot is read; the pipeline may overwrite it
    copies.issue_prologue(chunk_cur, first_pages);
  }
  float o_acc[kRowTiles][C::kDTiles][4], row_max[kRowTiles][2], row_sum[kRowTiles][2];  // rows 2c, 2c+1
  start_rows<C>(o_acc, row_max, row_sum);
  float score_scale[kRowTiles][2];
  scale_query_rows<C, T>(q_frag, score_scale, soft_cap, qk_scale, qk_scale_log2);
  uint2* q_smem = reinterpret_cast<uint2*>(smem + C::kQOffset) + (C::kFused ? warp_head : row_warp) * kRowTiles * C::kKSteps * 32;
  if constexpr (C::kQInSmem) share_query_operands<C>(q_smem, q_frag, lane, warp_rank, token_warp);

  // this thread's shared-memory offsets within a stage's first 16-token sub-tile (sub-tile k adds
  // k * data_offset(16) and k * 16 * kScaleBytes): K tokens ka and kb = ka + 2, in one padded group of
  // 4 rows; V tokens 4c..4c+3 (one padded group), head-dim bytes [g*kVChunk, +kVChunk)
  const int ka = tile_token(g), kb = ka + 2;
  const int k_off_a = C::data_offset(ka) + c * C::kKChunk, k_off_b = k_off_a + 2 * C::kDataBytes;
  const int ks_off_a = ka * C::kScaleBytes + c * (C::kKChunk / 8), ks_off_b = ks_off_a + 2 * C::kScaleBytes;
  const int v_off = C::data_offset(4 * c) + g * C::kVChunk, vs_off = 4 * c * C::kScaleBytes;

  __syncthreads();  // every warp reads the scale table (and the Q operands in shared memory)
  // the fused kernel: `tile` counts the warp's stages, so tile % kStages is still its ring's place
  for (int tile = 0; C::kFused ? chunk_cur < copies.warp_chunks : tile < num_tiles; tile += C::kTilesPerStep) {
    cp_async_wait<(kStages - 2 * C::kTilesPerStep) / C::kTilesPerStep>();  // a commit group per step
    // one row warp: a warp reads only the sub-tiles its own lanes copy, so a warp barrier orders its
    // copies and reads; row warps share their sub-tiles and need the block's barrier
    if constexpr (C::kTokenWarps == C::kWarps) __syncwarp();
    else __syncthreads();
    copies.issue_step(tile + kStages - C::kTilesPerStep, chunk_next, next_page);  // step 2
    const int chunk_after = chunk_next + warps_per_head;  // the fused kernel's step after next: its pages load now
#pragma unroll
    for (int u = 0; u < C::kTilesPerStep; ++u)
      next_page[u] = C::kFused ? copies.page_at(copies.chunk_pos(chunk_after, u)) : copies.page_of(tile + kStages + u);
    // the step's sub-tile j: this warp's sub-tile j % kSubTiles of stage tile + j / kSubTiles
    auto stage_of = [&](int j) { return smem + ((tile + j / C::kSubTiles) % kStages) * C::kStageBytes; };
    auto sub_of = [&](int j) { return token_warp + (j % C::kSubTiles) * C::kTokenWarps; };
#pragma unroll
    for (int first = 0; first < C::kStepSubTiles; first += C::kTilesPerStep) {  // steps 3, 4, 5
      float s_acc[C::kTilesPerStep][kRowTiles][4];
      ScoreArrays<C> score_arrays;
      tile_scores<C>(s_acc, score_arrays, stage_of, sub_of, first, k_off_a, k_off_b, ks_off_a, ks_off_b, scale_lut, q_smem, q_frag);
      int pos0[C::kTilesPerStep];
      bool masked[C::kTilesPerStep];
      uint32_t p_frag[C::kTilesPerStep][kRowTiles][2];
      SoftmaxArrays<C> softmax_arrays;
      online_softmax<C>(p_frag, pos0, masked, softmax_arrays, s_acc, o_acc, row_max, row_sum, score_scale, row_pos, p, sub_of, tile,
                        first, chunk_cur, begin, end, first_qpos, tile_shift, sub_mask, soft_cap, ka, kb);
      ValueArrays<C> value_arrays;
      tile_values<C>(o_acc, value_arrays, p_frag, stage_of, sub_of, first, v_off, vs_off, scale_lut, g * C::kVChunk);
    }
    if constexpr (C::kFused) chunk_cur = chunk_next, chunk_next = chunk_after;
  }

  // ---------------- step 6: the epilogue.  The output scale's load goes out before its barriers:
  // loaded after them (where it is used), its latency stalled every block of a one-wave grid at once
  const float v_scale = load_in_order(p.v_global_scale) * kDequantBias;
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the merge buffers
  store_warp_rows<C>(smem, o_acc, row_max, row_sum, row_warp, token_warp, g, c);
  auto partial_row = [&](int row, int head) {  // the row's partial row index (split-KV)
    const int64_t part = ((int64_t)req * p.num_kv_heads + kv_base + head) * p.num_splits + split;
    return part * p.max_rows + row - head * head_rows;
  };
  constexpr int kPieces = kHeadDim / 8;  // a row's 8-element pieces
  for (int idx = threadIdx.x; idx < rows * kPieces; idx += C::kThreads) {
    const int row = idx / kPieces, d0 = idx % kPieces * 8;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    merge_piece<C, T>(o, row, d0, p, smem, v_scale, head_rows, head_shift, warp_head_shift, partial_row, rows_of);
  }
  rotate_back<C, T>(p, smem, rows, head_rows, partial_row, rows_of);
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

// The static kernel for up to `rows` query rows (8, 16, 32 or 64): (row tiles per warp, row warps).
// Four row tiles where more than 16 rows fit (all but D 256): each row warp dequantizes every token
// it reads, so 17-32 rows take one row warp (each token dequantized once) and 33-64 at D 128 two;
// D 64's 33-64 rows keep four row warps of two (docs/kernels.md#registers-and-launch-bounds).
// decode_limits.cu checks each one's launch bound against the planner's blocks per SM.
struct RowConfig {
  int tiles, warps;
};
template <int kHeadDim>
constexpr RowConfig row_config(int rows) {
  if (rows <= 8) return {1, 1};
  if (kHeadDim == 256) return {1, rows <= 16 ? 2 : 4};
  if (rows <= 16) return {2, 1};
  if (rows <= 32) return {4, 1};
  return kHeadDim == 128 ? RowConfig{4, 2} : RowConfig{2, 4};
}
template <int kHeadDim, int kRows>
using RowConfigOf = Config<kHeadDim, row_config<kHeadDim>(kRows).tiles, row_config<kHeadDim>(kRows).warps>;

template <typename T, int kHeadDim, int kRows>
cudaError_t launch_rows(const DecodeParams& p, cudaStream_t stream) {
  constexpr RowConfig config = row_config<kHeadDim>(kRows);
  return launch<T, kHeadDim, config.tiles, config.warps>(p, stream);
}

// The first configuration that fits max_rows (the fused kernel where the plan asks for it).
template <typename T, int kHeadDim>
cudaError_t launch_for_rows(const DecodeParams& p, cudaStream_t stream) {
  if (p.fused_warps != 0) {  // decode_fused_ok: D <= 128, up to 16 rows
    if constexpr (kHeadDim <= 128) return p.max_rows <= 8 ? launch_fused<T, kHeadDim, 1>(p, stream)
                                                          : launch_fused<T, kHeadDim, 2>(p, stream);
    return cudaErrorInvalidValue;
  }
  if (p.max_rows <= 8) return launch_rows<T, kHeadDim, 8>(p, stream);
  if (p.max_rows <= 16) return launch_rows<T, kHeadDim, 16>(p, stream);
  if (p.max_rows <= 32) return launch_rows<T, kHeadDim, 32>(p, stream);
  if constexpr (decode_max_rows(kHeadDim) >= 64) {
    if (p.max_rows <= 64) return launch_rows<T, kHeadDim, 64>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace decode
}  // namespace nvfp4
