// Paged NVFP4 attention for decode / spec-decode / short extends.  Included by the
// paged_decode_hd*.cu files, one per head dim, so ninja builds them in parallel.
//
// Design (see DESIGN.md "Facts for the decode kernel"):
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
//  * static kernels: 4 warps; a 4-stage cp.async pipeline brings 64 tokens (K and V data + block scales) per stage
//    into shared memory; page indices are prefetched one loop iteration ahead.  The one-row-warp
//    kernels of hd64 and hd128 (up to 8 query rows with one row tile: plain decode; up to 16 with
//    two) take two stages per iteration, one softmax step for a warp's 16-token sub-tiles of both.
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
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

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

// ------------------------------------------------------------------ PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// dst: a shared address.  A negative zero_if_negative reads nothing and writes zeros (the ignore-src
// predicate, set inside the asm: a bool passed in became a register and a conversion back).
// .L2::128B: a miss fetches the whole 128-byte line into L2.  In token-major (NHD) pages a kv head's
// row is 64 bytes of a line whose other half is the next head's, read by another warp or block
// soon after: it then hits L2 instead of opening the DRAM row again (64 x 8192, 8 kv heads: 237 ->
// 201 us; head-major pages, whose copies read whole lines anyway, unchanged).
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, int zero_if_negative) {
  if constexpr (kBytes == 16) {
    asm volatile("{\n .reg .pred z;\n setp.lt.s32 z, %2, 0;\n cp.async.cg.shared.global.L2::128B [%0], [%1], 16, z;\n}\n"
                 ::"r"(dst), "l"(src), "r"(zero_if_negative));
  } else {
    asm volatile("{\n .reg .pred z;\n setp.lt.s32 z, %3, 0;\n cp.async.ca.shared.global.L2::128B [%0], [%1], %2, z;\n}\n"
                 ::"r"(dst), "l"(src), "n"(kBytes), "r"(zero_if_negative));
  }
}
// a * b + c, 32 x 32 bits + 64 bits: one IMAD.WIDE.U32
__device__ __forceinline__ const uint8_t* mad_wide(uint32_t a, uint32_t b, const uint8_t* c) {
  const uint8_t* d;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}
// base + token * token_stride + page * page_stride as 32 x 32 + 64-bit multiply-adds: in C++, nvcc
// added one 64-bit offset to each base (some 15 instructions for a stage's three sources)
__device__ __forceinline__ const uint8_t* paged_source(const uint8_t* base, uint32_t page, uint32_t page_stride,
                                                       uint32_t token, uint32_t token_stride) {
  return mad_wide(page, page_stride, mad_wide(token, token_stride, base));
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// The value unchanged, but opaque to the compiler: it must keep it in a register instead of
// recomputing it from the parameters and the thread index wherever it is used (in the tile loop)
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}
template <typename T>
__device__ __forceinline__ const T* opaque(const T* x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}
// Read-only loads that stay where they are written: nvcc sinks plain loads towards their first use,
// and volatile asm keeps its order with the copies' (volatile) asm
__device__ __forceinline__ float load_in_order(const float* src) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(src));
  return v;
}
__device__ __forceinline__ uint4 load_in_order(const uint4* src) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  return v;
}
__device__ __forceinline__ float4 load_in_order(const float4* src) {
  float4 v;
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src));
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// (a & mask) | (b & ~mask) in one LOP3
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
  return r;
}

// Four fp16 pairs from the 8 E2M1 codes of a word (code k at bits 4k..4k+3, sign on top): (n0,n4),
// (n2,n6), (n1,n5), (n3,n7), each code as value * 2^-14.  An E2M1 code smmm is the fp16 high byte
// s000mmm0 (low byte 0), so the codes are first laid out one per byte in that form, even codes in
// one word and odd codes in another (6 instructions), and then each pair is one byte permute with
// zero bytes between.  The masks: bit 3 of each byte is in 0x0E, so `sign` keeps only bit 7 there.
__device__ __forceinline__ void unpack_word(uint32_t q, uint32_t (&pairs)[4]) {
  const uint32_t sign = q & 0x88888888u;
  // sign << 4 as its own shift: in plain C++ nvcc turns (q & m) << 4 into (q << 4) & (m << 4), which
  // does not reuse `sign`: an AND more per word
  uint32_t sign4;
  asm("shl.b32 %0, %1, 4;\n" : "=r"(sign4) : "r"(sign));
  const uint32_t even = select_bits(q << 1, sign4, 0x0E0E0E0Eu);  // codes 0, 2, 4, 6
  const uint32_t odd = select_bits(q >> 3, sign, 0x0E0E0E0Eu);        // codes 1, 3, 5, 7
  pairs[0] = __byte_perm(even, 0u, 0x2404);  // {0, byte 0, 0, byte 2}
  pairs[1] = __byte_perm(even, 0u, 0x3414);  // {0, byte 1, 0, byte 3}
  pairs[2] = __byte_perm(odd, 0u, 0x2404);
  pairs[3] = __byte_perm(odd, 0u, 0x3414);
}
// Element (within the word) of each pair's low half, in unpack_word order; the high half is +4.
__device__ __forceinline__ constexpr int pair_element(int j) { return j == 0 ? 0 : j == 1 ? 2 : j == 2 ? 1 : 3; }

// ------------------------------------------------------------------ configuration
constexpr int cmax(int a, int b) { return a > b ? a : b; }
template <int kHeadDim, int kRowTiles, int kRowWarps, int kFusedWarps = 0>
struct Config {
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
  // (hd128 / hd64 3-10 % faster; hd256, whose tile work is twice hd128's, was 1 % slower at 64 x 8192).
  // The two-row-tile kernel (up to 16 rows: q_len 4 at group 4) pairs too; at hd128 that needs some 160
  // registers, so its bound is 3 blocks per SM instead of 4 (no spills on sm_80, sm_90, sm_120)
  static constexpr int kTilesPerStep = kRowWarps == 1 && kHeadDim <= 128 ? 2 : 1;
  static constexpr int kStepSubTiles = kTilesPerStep * kSubTiles;
  static constexpr int kRowsPerWarp = kRowTiles * 8;
  static constexpr int kMaxRows = kRowsPerWarp * kRowWarps;
  static constexpr int kKSteps = kHeadDim / 16;          // QK k-steps over the head dim
  static constexpr int kDTiles = kHeadDim / 16;          // PV m-tiles over the head dim
  static constexpr int kKChunk = kDataBytes / 4;         // K bytes per thread per token
  static constexpr int kVChunk = kDataBytes / 8;         // V bytes per thread per token
  // data rows are padded by 32 bytes every 4 rows so the V reads of a warp (4 rows, 4 apart)
  // fall in different banks.  Not in hd128's fused kernel of one row tile (plain decode): unpadded, its
  // loads conflict more (ncu: 2.6 ways on average), and yet on an H200 it ran 4.5-5 % faster back
  // to back (64 x 8192 173.3-174.2 against 181.6-182.0 us, 1 x 131072 55.3-55.7 against 58.0-58.4, 8 x
  // 32768 and 32 x 8192 alike: results/h200-2026-12-01-06016e9/).  Why is not known: the loop's
  // instructions are the same (1206 against 1207), and at ncu's locked clock it is as much faster (IPC 2.83
  // against 2.73, with 2.6-way conflicts on its loads).  It is not mainly the banks, nor the carveout: a
  // 160-byte pad, bank for bank 32's, ran 0.8-1.4 % behind unpadded, and the largest carveout left 32 as
  // slow (results/h200-2026-12-01-bc5c76e/).  Unpadded, the static kernels lost up to 11 % at D 256 (128 x
  // 512 74 -> 82 us) and were flat to 3 % slower at D 128 and 64, and the two-row-tile fused kernel and
  // hd64's were flat or slower: they keep the pad.
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
  // kernels with two row tiles and up to two row warps keep the Q^T operands in shared memory, one
  // copy per row warp ([row warp][tile][k-step][lane] x 8 bytes), instead of 16 registers per row
  // tile per thread: their registers would otherwise allow one block per SM fewer (the 64-row kernel
  // is held to 3 by its registers and shared memory either way)
  static constexpr bool kQInSmem = kRowTiles > 1 && kRowWarps <= 2;
  static constexpr int kQOffset = kLutOffset + 256 * 4;
  static constexpr int kQBytes = kQInSmem ? (kFused ? kMaxHeads : kRowWarps) * kRowTiles * kKSteps * 32 * 8 : 0;
  static constexpr int kSmemBytes = kQOffset + kQBytes;
  // The kernel's launch bound (blocks per SM that its registers must allow).  Two row tiles and up to
  // two row warps: 4 (at most 128 registers, the Q operands in shared memory; no spills at hd128 on
  // sm_80 and sm_90), but 3 where hd128's take two stages per iteration (some 160 registers).  One
  // row tile and one row warp: 4 at hd64 and hd128, the split planner's target (96 and 126
  // registers, no spills).  Bounds of 8 (hd64) and 5 (hd128) had squeezed them into 64 and 96
  // registers with spills, and at hd128 loop indices recomputed every iteration: 3-5 % slower at
  // 64 x 8192 (results/h200-2026-11-30-473cf26 and -2453bfa).  hd256: 2, what its shared memory
  // allows on sm_80 and sm_90 (unbounded, ptxas gave the fp16 32-row kernel 168 registers and
  // spills).  0 leaves the others to the compiler.
  // fused: one block of 16 warps (128 registers, as the static one-row-tile kernel's 4 blocks) or 12
  // (170: the hd128 two-row-tile kernel's 3 blocks; ptxas gives hd64's 120-126)
  static constexpr int kMinBlocksPerSm = kFused ? (kRowTiles == 1 ? 16 : 12) / kWarps
                                         : kQInSmem ? (kTilesPerStep == 2 && kHeadDim == 128 ? 3 : 4)
                                         : kRowTiles == 1 && kRowWarps == 1 && kHeadDim <= 128 ? 4
                                         : kHeadDim == 256                                     ? 2
                                                                                               : 0;
  // Which kernels may copy whole token rows (the kernel's kRowCopies) where a token's kv heads lie
  // side by side (NHD pages, SGLang's token rows: head stride = a head's row).  There a head's row is part of a line the
  // neighbouring heads share, and copying one sector of 16 tokens' rows per warp instruction (the
  // head-major pages' order, whole sectors of contiguous rows) made each instruction touch 16 lines for a
  // sector each; whole rows, kDataBytes / 16 threads per token, touch half as many lines for two
  // sectors each.  On an H200 (results/h200-2026-12-01-21fa567/row-copies/, isolated): NHD pages of 16, 64 x
  // 8192 210-211 -> 184-185 us, 1 x 131072 67.8 -> 58.5-58.9, 8 x 32768 119 -> 103-104; token rows (page
  // 1) 64 x 8192 373 -> 219, 16 x 8192 75.3 -> 64; D 256 64 x 4096 213 -> 205.  Head-major pages keep the
  // sector order (a warp's 16 contiguous rows are whole lines either way): their kernels are unchanged
  // (as a runtime branch instead of a template argument, the copy order had cost head-major 4-query-token
  // decode 2-4 % through the two-row-tile kernels' registers).  Kernels of one row warp, whose warps copy
  // only the sub-tiles they read; with two row tiles (4 query tokens) the gain is 0-4 % (1 x 131072 79.1
  // -> 76.1-76.4 us).  D 64's row is one sector: nothing to change.
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

// Token within a 16-token MMA tile held at MMA row m: rows (2c, 2c+1, 2c+8, 2c+9) are the
// 4 consecutive tokens 4c..4c+3, so the PV operand of thread c reads 4 adjacent rows.
__device__ __forceinline__ int tile_token(int m) { return 4 * ((m & 7) >> 1) + (m & 1) + ((m >> 3) << 1); }

// Unnormalized Walsh-Hadamard transform of `rows` rows of kHeadDim floats in shared memory, in
// place (KV mode "hadamard": x H = fwht(x) / sqrt(D)).  Every thread of the block calls it; it
// starts and ends with a barrier.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void fwht_rows(float* buf, int rows) {
  __syncthreads();
  for (int h = 1; h < kHeadDim; h *= 2) {
    for (int idx = threadIdx.x; idx < rows * (kHeadDim / 2); idx += kThreads) {
      const int j = idx % (kHeadDim / 2);
      float* x = buf + (idx / (kHeadDim / 2)) * kHeadDim + (j / h) * 2 * h + j % h;
      const float a = x[0], b = x[h];
      x[0] = a + b;
      x[h] = a - b;
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ the kernel
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

// Combine the splits of one query row of one (request, kv head) per block.  Each group of kHeadDim / 4
// threads (float4 loads) folds its share of the splits into a running maximum, sum and output, eight
// splits per round, and the groups combine once in shared memory.  A round's loads are written
// before any use (ptxas still issues the outputs' loads after the first exp2f: two latencies per
// round); the former two passes, the splits' maximum and then their weights, cost three in a row
// (4.6-4.8 us at 1 x 131072, now 3.3-3.6).  The block has as many groups as one round needs (at
// least a warp), up to kMergeMaxThreads: 512 threads for each of 1024 rows of 2 splits cost ~9 us
// more.  Sums go in a fixed order, so results are run-to-run identical.
constexpr int kMergeMaxThreads = 512;
constexpr int kMergeBatch = 8;  // splits per group and round
template <int kHeadDim>
constexpr int merge_threads(int num_splits) {
  const int threads = (num_splits + kMergeBatch - 1) / kMergeBatch * (kHeadDim / 4);
  return threads < 32 ? 32 : threads > kMergeMaxThreads ? kMergeMaxThreads : (threads + 31) / 32 * 32;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kMergeMaxThreads) merge_splits_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kGroupThreads = kHeadDim / 4, kMaxGroups = kMergeMaxThreads / kGroupThreads;
  const int groups = blockDim.x / kGroupThreads;
  __shared__ float group_max[kMaxGroups], group_sum[kMaxGroups];
  __shared__ __align__(16) float group_out[kMaxGroups][kHeadDim];
  const int row = blockIdx.x, kv_head = blockIdx.y, req = blockIdx.z;
  const int q_start = p.query_start_loc[req];
  const int rows = min((p.query_start_loc[req + 1] - q_start) * p.group_size, p.max_rows);
  if (row >= rows) return;
  const int head = kv_head * p.group_size + row % p.group_size;
  // loaded before the splits' (after them, each was a memory latency between the last barrier and the stores)
  const float sink = p.sinks != nullptr ? __ldg(p.sinks + head) * kLog2e : -INFINITY;
  const float v_scale = __ldg(p.v_global_scale) * kDequantBias;
  const int64_t first = ((int64_t)req * p.num_kv_heads + kv_head) * p.num_splits * p.max_rows + row;
  const float* split_max = p.partial_max + first;  // split s at s * max_rows
  const float* split_sum = p.partial_sum + first;
  const int group = threadIdx.x / kGroupThreads, d4 = 4 * (threadIdx.x % kGroupThreads);
  const float* split_out = p.partial_out + first * kHeadDim + d4;  // split s at s * max_rows * kHeadDim

  float m = -INFINITY, l = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = group; s0 < p.num_splits; s0 += groups * kMergeBatch) {
    float ms[kMergeBatch], ls[kMergeBatch];
    float4 os[kMergeBatch];
    // the round's loads first, volatile (nvcc sank plain ones below the first exp2f; ptxas still
    // moves most output loads after it); past the last split, the last one again, weighed 0 below
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const int64_t s = min(s0 + i * groups, p.num_splits - 1);
      os[i] = load_in_order(reinterpret_cast<const float4*>(split_out + s * p.max_rows * kHeadDim));
      ms[i] = load_in_order(split_max + s * p.max_rows);
      ls[i] = load_in_order(split_sum + s * p.max_rows);
    }
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      if (s0 + i * groups >= p.num_splits) ms[i] = -INFINITY;  // weight exp2(-inf) = 0
    }
    float m_new = m;
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) m_new = fmaxf(m_new, ms[i]);  // fmaxf drops a NaN maximum ...
    const float base = m_new == -INFINITY ? 0.f : m_new;
    const float a = exp2f(m - base);
    l *= a, acc.x *= a, acc.y *= a, acc.z *= a, acc.w *= a;
#pragma unroll
    for (int i = 0; i < kMergeBatch; ++i) {
      const float f = exp2f(ms[i] - base);  // ... whose weight is NaN, and so are the sum and output
      l += f * ls[i];
      acc.x += f * os[i].x, acc.y += f * os[i].y, acc.z += f * os[i].z, acc.w += f * os[i].w;
    }
    m = m_new;
  }
  if (threadIdx.x % kGroupThreads == 0) group_max[group] = m, group_sum[group] = l;
  *reinterpret_cast<float4*>(&group_out[group][d4]) = acc;
  __syncthreads();

  float m_all = sink;
  for (int g = 0; g < groups; ++g) m_all = fmaxf(m_all, group_max[g]);
  const float base = m_all == -INFINITY ? 0.f : m_all;
  float l_all = 0.f;
  for (int g = 0; g < groups; ++g) l_all += exp2f(group_max[g] - base) * group_sum[g];
  if (p.sinks != nullptr) l_all += exp2f(sink - base + kWeightBiasLog2);
  T* dst = static_cast<T*>(p.out) + (int64_t)(q_start + row / p.group_size) * p.out_stride_token +
           (int64_t)head * p.out_stride_head;
  for (int d = threadIdx.x; d < kHeadDim; d += blockDim.x) {
    float o = 0.f;
    for (int g = 0; g < groups; ++g) o += exp2f(group_max[g] - base) * group_out[g][d];
    store(dst + d, l_all == 0.f ? 0.f : o * (v_scale / l_all));
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
