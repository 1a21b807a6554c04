// Decode kernel constants and its compile-time configuration (Config): warps, pipeline stages,
// shared-memory layout and launch bounds per (head dim, row tiles, row warps, fused warps).
// Why each choice: docs/kernels.md#decode.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "half_types.cuh"

namespace nvfp4 {
namespace decode {

constexpr int kStages = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kDequantBias = 128.0f;   // dequantized K/V carry a factor 2^-7
// Softmax weights are computed times 2^15 (at most 2^15 <= fp16's 65504), so in fp16 they stay
// normal down to 2^-29 of the row maximum instead of 2^-14.  The output's numerator and the row
// sums carry the same factor, which cancels; only the sinks' weights must be given it too.
constexpr float kWeightBiasLog2 = 15.0f;

// The MMAs run in fp16 for both query dtypes: E2M1 x E4M3 x 2^-7 is exact in fp16 (at most 6
// significant bits, 2^-17 .. 21), the softmax weights keep 3 more bits than in bf16, and an E2M1
// code is a single fp16 high byte, which is what makes the unpack below cheap.  bf16 queries are scaled by
// a power of two per row into fp16's range (exact but for elements some 2^31 below the row's
// maximum, which lose bits, and 2^39 below, which become 0).
constexpr float kScaleBias = 128.0f;  // E2M1 codes unpack as value * 2^-14; scales carry 2^7: 2^-7
__device__ __forceinline__ uint32_t scale2(float s) { return pack2(s * kScaleBias, s * kScaleBias, __half()); }
__device__ __forceinline__ void store(__half* dst, float x) { *dst = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* dst, float x) { *dst = __float2bfloat16_rn(x); }

constexpr int cmax(int a, int b) { return a > b ? a : b; }
template <int HeadDim, int RowTiles, int RowWarps, int FusedWarps = 0>
struct Config {
  static constexpr int kHeadDim = HeadDim, kRowTiles = RowTiles, kRowWarps = RowWarps, kFusedWarps = FusedWarps;
  // kFusedWarps > 0: the fused kernel (one row warp, two stages per step): that many warps per block,
  // warp w on the block's kv head w % heads, the rank w / heads of its head's warps_per_head, taking its
  // head's 32-token steps rank, rank + warps_per_head, ...; a warp holds its own head's rows.
  // 0: 4 warps, each on every 4th 16-token sub-tile of one kv head (or packed heads' shares)
  static constexpr bool kFused = kFusedWarps > 0;
  static constexpr int kWarps = kFused ? kFusedWarps : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileTokens = 16 * kWarps;  // tokens per pipeline stage: 16 per warp
  static constexpr int kMaxHeads = kFused ? 8 / kRowTiles : 4;  // kv heads per block
  static constexpr int kDataBytes = kHeadDim / 2;       // per token-head
  static constexpr int kScaleBytes = kHeadDim / 16;
  static constexpr int kTokenWarps = kWarps / kRowWarps;
  static constexpr int kSubTiles = kTileTokens / 16 / kTokenWarps;  // 16-token sub-tiles per warp and stage
  // Stages per loop iteration, and sub-tiles per softmax step.  The one-row-warp one-row-tile kernels
  // take two stages at a time, and a warp's sub-tiles of both share one softmax step: the row maxima's
  // shuffles, the rescale test and the loop's own work are paid once per 32 tokens instead of 16
  // (not at hd256, whose tile work is twice hd128's: there it did not pay; docs/kernels.md#decode).
  // The two-row-tile kernel (up to 16 rows: q_len 4 at group 4) pairs too; at hd128 that needs some 160
  // registers, so its bound is 3 blocks per SM instead of 4 (no spills on sm_80, sm_90, sm_120)
  static constexpr int kTilesPerStep = kRowWarps == 1 && kHeadDim <= 128 ? 2 : 1;
  static constexpr int kStepSubTiles = kTilesPerStep * kSubTiles;
  static constexpr int kRowsPerWarp = kRowTiles * 8;
  static constexpr int kMaxRows = kRowsPerWarp * kRowWarps;
  static constexpr int kKSteps = kHeadDim / 16;          // QK k-steps over the head dim
  static constexpr int kQPieces = kHeadDim / 32;         // 16-byte query pieces per thread and row
  static constexpr int kDTiles = kHeadDim / 16;          // PV m-tiles over the head dim
  static constexpr int kKChunk = kDataBytes / 4;         // K bytes per thread per token
  static constexpr int kVChunk = kDataBytes / 8;         // V bytes per thread per token
  // data rows are padded by 32 bytes every 4 rows so the V reads of a warp (4 rows, 4 apart)
  // fall in different banks.  Not in hd128's fused kernel of one row tile (plain decode): unpadded, its
  // loads conflict more, and yet it ran faster on an H200, with the same loop instructions.  Why is not
  // known; it is not mainly the banks (a pad of 160 bytes, bank for bank 32's, stayed behind unpadded),
  // nor the shared-memory carveout.  The static kernels (most of all at D 256), the two-row-tile fused
  // kernel and hd64's were as fast or slower unpadded: they keep the pad (docs/kernels.md#decode).
  static constexpr int kRowPad = kFused && kRowTiles == 1 && kHeadDim == 128 ? 0 : 32;
  static constexpr int data_offset(int row) { return row * kDataBytes + (row >> 2) * kRowPad; }
  static constexpr int kDataStage = data_offset(kTileTokens);
  static constexpr int kScaleStage = kTileTokens * kScaleBytes;
  static constexpr int kStageBytes = 2 * (kDataStage + kScaleStage);
  static constexpr int kPipelineBytes = kStages * kStageBytes;
  // per token warp and row: the output row, its running max and sum
  static constexpr int kMergeBytes = kTokenWarps * kMaxRows * (kHeadDim + 2) * 4;
  // KV mode "hadamard": the block's query rows (all its heads'), rotated, and its output rows before
  // they are rotated back.  The static kernel's rows (at most kMaxRows) take token warp 0's merge slot,
  // which only the thread merging an element reads; the fused kernel's, kMaxRows per head, follow the
  // merge buffers
  static constexpr int kMaxBlockRows = kFused ? kMaxRows * kMaxHeads : kMaxRows;
  static constexpr int kRotOffset = kFused ? kMergeBytes : 0;
  static constexpr int kRotEnd = kRotOffset + kMaxBlockRows * kHeadDim * 4;
  static constexpr int kBufferBytes = cmax(kPipelineBytes, cmax(kMergeBytes, kRotEnd));
  // E4M3 byte -> packed fp16 {scale, scale} * kScaleBias: one shared load per block scale
  // instead of a dozen conversion instructions
  static constexpr int kLutOffset = (kBufferBytes + 15) / 16 * 16;
  // kernels of two or four row tiles and up to two row warps keep the Q^T operands in shared memory,
  // one copy per row warp ([row warp][tile][k-step][lane] x 8 bytes), instead of kKSteps * 2 registers
  // per row tile per thread: their registers would otherwise allow one block per SM fewer (D 64's
  // 64-row kernel of four row warps is held to 3 by its registers and shared memory either way)
  static constexpr bool kQInSmem = kRowTiles > 1 && kRowWarps <= 2;
  static constexpr int kQOffset = kLutOffset + 256 * 4;
  static constexpr int kQBytes = kQInSmem ? (kFused ? kMaxHeads : kRowWarps) * kRowTiles * kKSteps * 32 * 8 : 0;
  static constexpr int kSmemBytes = kQOffset + kQBytes;
  // The kernel's launch bound (blocks per SM that its registers must allow).  Two row tiles and up to
  // two row warps: 4 (at most 128 registers, the Q operands in shared memory; no spills at hd128 on
  // sm_80 and sm_90), but 3 where hd128's take two stages per iteration (some 160 registers).  One
  // row tile and one row warp: 4 at hd64 and hd128, the split planner's target (96 and 126
  // registers, no spills).  Bounds of 8 (hd64) and 5 (hd128) had squeezed them into 64 and 96
  // registers with spills, and at hd128 loop indices recomputed every iteration: slower
  // (docs/kernels.md#decode).  hd256: 2, what its shared memory
  // allows on sm_80 and sm_90 (unbounded, ptxas gave the fp16 32-row kernel 168 registers and
  // spills).  Four row tiles (17-32 rows, and 33-64 at hd128): 2, the planner's count
  // for those rows (hd64 188-196 registers, hd128 240-255; no spills at sm_90 and sm_120).  Bound to 3,
  // hd64's spilled and was 1-3 % slower (docs/decisions.md).  0 leaves the others to the compiler.
  // fused: one block of 16 warps (128 registers, as the static one-row-tile kernel's 4 blocks) or 12
  // (170: the hd128 two-row-tile kernel's 3 blocks; ptxas gives hd64's 120-126)
  static constexpr int kMinBlocksPerSm = kFused ? (kRowTiles == 1 ? 16 : 12) / kWarps
                                         : kRowTiles == 4 ? 2
                                         : kQInSmem ? (kTilesPerStep == 2 && kHeadDim == 128 ? 3 : 4)
                                         : kRowTiles == 1 && kRowWarps == 1 && kHeadDim <= 128 ? 4
                                         : kHeadDim == 256                                     ? 2
                                                                                               : 0;
  // Which kernels may copy whole token rows (the kernel's kRowCopies) where a token's kv heads lie
  // side by side (NHD pages, SGLang's token rows: head stride = a head's row).  There a head's row is
  // part of a line the neighbouring heads share, and copying one sector of 16 tokens' rows per warp instruction (the
  // head-major pages' order, whole sectors of contiguous rows) made each instruction touch 16 lines for a
  // sector each; whole rows, kDataBytes / 16 threads per token, touch half as many lines for two
  // sectors each (docs/kernels.md#decode).  Head-major pages keep the sector order (a warp's 16
  // contiguous rows are whole lines either way): their kernels are unchanged (as a runtime branch
  // instead of a template argument, the copy order had cost head-major decode through the two-row-tile
  // kernels' registers).  Kernels of one row warp, whose warps copy only the sub-tiles they read; with
  // two row tiles (4 query tokens) the gain is small.  D 64's row is one sector: nothing to change.
  static constexpr bool kRowCopiesServe = kDataBytes >= 64 && kRowTiles <= 2 && kRowWarps == 1;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim");
  static_assert(kTileTokens % (16 * kTokenWarps) == 0, "tile");
  static_assert(kTilesPerStep == 1 || kSubTiles == 1, "a softmax step: a warp's sub-tiles of one stage, or its one sub-tile of each");
  static_assert(kStages >= 2 * kTilesPerStep, "the next step's stages fill while this step's are read");
  static_assert(kStages % kTilesPerStep == 0, "a step's stages are consecutive in the ring, one commit group per step");
  static_assert(kThreads == 2 * kTileTokens && kTileTokens == 16 * kWarps, "copies: two threads per token, a warp per sub-tile");
  static_assert(!kFused || (kRowWarps == 1 && kTilesPerStep == 2 && kWarps % kMaxHeads == 0),
                "fused: a warp's own rows, 32-token steps, as many warps on each head");
  static_assert(kDataBytes % 32 == 0, "copies: a token's two threads take 16 bytes of each 32-byte sector");
};

}  // namespace decode
}  // namespace nvfp4
