// The prefill kernel's configuration (shared-memory layout, copy split, launch bounds) and its small
// helpers.  The design: prefill_kernel.cuh and docs/kernels.md#prefill.
#pragma once
#include "decode_config.cuh"      // the numerics shared with decode: kScaleBias, kWeightBiasLog2, scale2
#include "decode_primitives.cuh"  // the PTX wrappers and unpack_word
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

#ifndef NVFP4_PREFILL_MIN_BLOCKS_HD64
#define NVFP4_PREFILL_MIN_BLOCKS_HD64 3
#endif

namespace nvfp4 {
namespace prefill {

using decode::cp_async;
using decode::cp_async_commit;
using decode::cp_async_wait;
using decode::fast_exp2;
using decode::mma;
using decode::mul2;
using decode::scale2;
using decode::smem_addr;
using decode::unpack_word;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kValueBias = 128.0f;  // dequantized K/V carry 2^-7 (decode::kScaleBias)
using decode::kWeightBiasLog2;        // softmax weights x 2^15: fp16 keeps them normal down to 2^-29 of the max

template <int kHeadDim_, int kCopyBytes_>
struct Config {
  static constexpr int kHeadDim = kHeadDim_, kCopyBytes = kCopyBytes_;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  // m16 row tiles per warp: two where the registers allow (each K and V fragment read from shared
  // memory then feeds two MMAs: shared-memory bandwidth, not the tensor cores, bounds one), one at D 256
  static constexpr int kRowTiles = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kWarpRows = 16 * kRowTiles;
  static constexpr int kRows = kWarpRows * kWarps;  // packed query rows per block
  static_assert(kRows == prefill_rows(kHeadDim), "the host sizes tiles by prefill_rows()");
  static constexpr int kTileTokens = kHeadDim <= 128 ? 64 : 32;  // KV positions per tile (docs/kernels.md#prefill)
  static constexpr int kPitch = kHeadDim + 8;  // 16-bit elements per row: the 16-byte pad keeps ldmatrix conflict-free
  static constexpr int kDataBytes = kHeadDim / 2, kScaleBytes = kHeadDim / 16;
  static constexpr int kStages = 2;  // NVFP4 tiles in flight (three measured no faster: docs/decisions.md)
  // shared memory: Q rows, the dequantized K and V tiles, the copy stages, the E4M3 -> fp16x2 table
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kRows * kPitch * 2;
  static constexpr int kVOffset = kKOffset + kTileTokens * kPitch * 2;
  // a stage: K codes, V codes (tokens x kDataBytes each), K scales, V scales (tokens x kScaleBytes)
  static constexpr int kStageOffset = kVOffset + kTileTokens * kPitch * 2;
  static constexpr int kStageBytes = 2 * kTileTokens * (kDataBytes + kScaleBytes);
  static constexpr int kLutOffset = kStageOffset + kStages * kStageBytes;
  // per row: the logit scale (raw score -> logit in log2 units: the row's power of two inside) and the
  // cache position (-1: no such row), read per tile instead of held in registers
  static constexpr int kRowInfoOffset = kLutOffset + 256 * 4;
  static constexpr int kSmemBytes = kRowInfoOffset + kRows * 8;
  // the epilogue's fp32 output rows reuse Q, K and V's space once the loop is done
  static constexpr int kOutPitch = kHeadDim + 4;
  static_assert(kWarps * kWarpRows * kOutPitch * 4 <= kStageOffset, "the epilogue's rows must fit the tiles' space");
  // the copies: kCopyThreads threads per token share its K and V codes; two of them its scales
  static constexpr int kCopyThreads = kThreads / kTileTokens;
  static constexpr int kChunks = 2 * kDataBytes / kCopyBytes / kCopyThreads;  // data copies per thread
  static_assert(kCopyThreads >= 2 && kChunks * kCopyThreads * kCopyBytes == 2 * kDataBytes, "copy split");
  static constexpr int kElementsPerLane = kHeadDim / 32;  // a row across a warp (Q load, epilogue)
  // resident blocks the registers must allow (two: each block's barriers leave the tensor cores idle;
  // three at D 64, where 168 registers fit with a small spill and short windowed tiles are latency-bound
  // at two: docs/decisions.md, extend; NVFP4_PREFILL_MIN_BLOCKS_HD64 sets it for an A/B)
  static constexpr int kMinBlocks = kHeadDim == 64 ? NVFP4_PREFILL_MIN_BLOCKS_HD64 : 2;
};

// ------------------------------------------------------------------ small helpers
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Where element e of an 8-element group is stored (unpack_word's pair order; an involution).
__device__ __forceinline__ constexpr int stored_at(int e) { return (e & 1) * 4 + (e >> 1 & 1) * 2 + (e >> 2 & 1); }
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// tanh(x) = 1 - 2 / (e^2x + 1): ex2 and a reciprocal, accurate to ~1e-7 absolute (tanh.approx's 2^-11
// relative error moves capped logits by up to cap x 5e-4, visibly in the softmax)
__device__ __forceinline__ float tanh_accurate(float x) {
  return 1.0f - 2.0f * fast_rcp(fast_exp2(2.0f * kLog2e * x) + 1.0f);
}
// x H for a row spread over a warp, lane holding elements [lane * E, lane * E + E): Sylvester-order
// fast Walsh-Hadamard butterflies in fp32 (format.hadamard_transform), then one multiply.
template <int E>
__device__ __forceinline__ void hadamard_row(float (&x)[E], float scale) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 1; h < E; h <<= 1)
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (!(j & h)) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = (lane & m) ? other - x[j] : x[j] + other;
    }
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] *= scale;
}

}  // namespace prefill
}  // namespace nvfp4
