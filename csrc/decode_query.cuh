// The decode kernels' queries: the raw query bits, the Q^T MMA operands built from them (or from the
// rotated rows in KV mode "hadamard"), bf16 rows moved into fp16's range, and the operands kept in
// shared memory where registers are short (docs/kernels.md#decode).
#pragma once
#include <cstdint>
#include <type_traits>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "decode_rows.cuh"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// Scores in log2 units: exp2(s * qk_scale_log2) == exp(s * softmax_scale * k_global * 2^7).
struct ScoreScale {
  float qk_scale, qk_scale_log2;
  bool soft_cap;
  __device__ __forceinline__ explicit ScoreScale(const DecodeParams& p)
      : qk_scale(p.softmax_scale * __ldg(p.k_global_scale) * kDequantBias), qk_scale_log2(qk_scale * kLog2e),
        soft_cap(p.logits_soft_cap > 0.f) {}
};

// A thread's raw query bits: row n of row tile t is MMA row n; its elements are the D/4 from c * D/4,
// kQPieces 16-byte pieces (piece m: elements 8m .. 8m + 7, k-steps 2m, 2m + 1).
template <class C>
using QueryPieces = uint4[C::kRowTiles][C::kQPieces];

// The Q^T operands (row n of row tile t is query row n of the warp's tile t; k-step s, slot half holds
// elements e and e + 4, q_element) and the cache positions of the thread's rows 2c, 2c + 1 (-1: no
// such row); score_scale: (soft-cap ? qk_scale : qk_scale_log2) * 2^-row_exp of those rows.
template <class C>
struct QueryOperands {
  uint32_t frag[C::kRowTiles][C::kKSteps][2];
  int pos[C::kRowTiles][2];
  float score_scale[C::kRowTiles][2];
  const uint2* smem;  // C::kQInSmem: the warp's copy of frag in shared memory, [tile][k-step][lane]
};

// The element of a row that thread c's slot `half` of k-step s holds (the high half of the pair: + 4).
template <class C>
__device__ __forceinline__ int q_element(int c, int s, int half) {
  return c * (C::kHeadDim / 4) + 8 * (s >> 1) + pair_element((s & 1) * 2 + half);
}

// The raw query bits load first and become operands only after the first copies go out: issued after
// the copies, they waited behind that burst, and consumed before them, they held the copies back.  They
// load as 16-byte pieces (the binding requires 16-byte aligned rows): as 2-byte elements they had queued
// behind each other at the kernel's start.  Not in KV mode "hadamard", whose operands come from the
// rotated rows (the pieces stay zero there).
template <class C, typename T, class Rows>
__device__ __forceinline__ void load_query_pieces(QueryPieces<C>& q, const DecodeParams& p, const Rows& b) {
  if (!p.hadamard) {
#pragma unroll
    for (int t = 0; t < C::kRowTiles; ++t) {
      const int row = b.tile_first_row(t) + b.g;
      const bool live = b.query_live(t);
      const uint4* qrow = reinterpret_cast<const uint4*>(b.template query_row<T>(p, row, live) + b.c * (C::kHeadDim / 4));
#pragma unroll
      for (int m = 0; m < C::kQPieces; ++m) q[t][m] = live ? load_in_order(qrow + m) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// KV mode "hadamard": the block's query rows, rotated, as fp32 in the (still unused) pipeline buffers
// (kMaxBlockRows x D x 4 bytes fit); rows past `rows` are zero.
template <class C, typename T, class Rows>
__device__ __forceinline__ void rotate_queries(const DecodeParams& p, const Rows& b, float* q_rot) {
  for (int idx = threadIdx.x; idx < C::kMaxBlockRows * C::kHeadDim; idx += C::kThreads) {
    const int row = idx / C::kHeadDim, d = idx % C::kHeadDim;
    q_rot[idx] = row < b.rows ? to_float(static_cast<const T*>(p.q)[row_offset(p, b, row, p.q_stride_token, p.q_stride_head) + d])
                              : 0.f;
  }
  fwht_rows<C::kHeadDim, C::kThreads>(q_rot, b.rows);  // rows past `rows` stay zero
}

// The Q^T operands from the raw bits (or the rotated rows), and the cache positions of the rows.
template <class C, typename T, class Rows>
__device__ __forceinline__ void build_query_operands(QueryOperands<C>& q, const DecodeParams& p, const Rows& b,
                                                     const QueryPieces<C>& pieces, const float* q_rot) {
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
    const float* rotated = q_rot + (b.tile_first_row(t) + b.g) * C::kHeadDim;
#pragma unroll
    for (int s = 0; s < C::kKSteps; ++s)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int e = q_element<C>(b.c, s, half);
        // piece s / 2 holds elements {e0 e1, e2 e3, e4 e5, e6 e7}; slot half of k-step s is (e_j, e_j+4),
        // j = pair_element(2 (s % 2) + half): low halves of words (half, half + 2) for even s, high for odd
        const uint4 piece = pieces[t][s >> 1];
        const uint32_t q_pair = __byte_perm(half ? piece.y : piece.x, half ? piece.w : piece.z, s & 1 ? 0x7632 : 0x5410);
        q.frag[t][s][half] = p.hadamard ? pack2(rotated[e] * p.hadamard_scale, rotated[e + 4] * p.hadamard_scale, T())
                                        : q_pair;
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = b.tile_first_row(t) + 2 * b.c + i;
      const bool live = b.row_live(t, i);
      q.pos[t][i] = live ? b.seq_len - b.q_len + b.token(p, r) : -1;
    }
  }
}

// bf16 rows move into fp16 times 2^row_exp, which puts the row's largest magnitude in [2^14, 2^15)
// (maxima below 2^-113 take 2^127 and end lower, still exact); the softmax divides it out through
// score_scale.
template <class C, typename T>
__device__ __forceinline__ void scale_query_rows(QueryOperands<C>& q, const ScoreScale& sc, int c) {
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
    int row_exp = 0;
    if constexpr (!std::is_same_v<T, __half>) {
      float amax = 0.f;  // a NaN element drops out here and stays NaN in its fragment
#pragma unroll
      for (int s = 0; s < C::kKSteps; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 v = to_float2(q.frag[t][s][half], T());
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
          const float2 v = to_float2(q.frag[t][s][half], T());
          q.frag[t][s][half] = pack2(v.x * q_scale, v.y * q_scale, __half());
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      q.score_scale[t][i] = ldexpf(sc.soft_cap ? sc.qk_scale : sc.qk_scale_log2, -__shfl_sync(0xffffffffu, row_exp, (2 * c + i) * 4));
  }
}

// Kernels with C::kQInSmem keep the operands in shared memory (Config says why), stored by one warp per
// copy; read after the barrier before the tile loop.
template <class C, class Rows>
__device__ __forceinline__ void store_query_operands(QueryOperands<C>& q, uint8_t* smem, const Rows& b) {
  uint2* q_smem = reinterpret_cast<uint2*>(smem + C::kQOffset) + b.operand_copy() * C::kRowTiles * C::kKSteps * 32;
  q.smem = q_smem;
  if constexpr (C::kQInSmem) {
    if (b.stores_operands()) {
#pragma unroll
      for (int t = 0; t < C::kRowTiles; ++t)
#pragma unroll
        for (int s = 0; s < C::kKSteps; ++s)
          q_smem[(t * C::kKSteps + s) * 32 + b.lane] = make_uint2(q.frag[t][s][0], q.frag[t][s][1]);
    }
  }
}

// The query steps between the first copies and the tile loop: the copies of the first steps
// (issue_prologue) go out before the scale table and the Q^T operands are built, which they then
// overlap; in KV mode "hadamard" the pipeline buffers first hold the rotated query rows, and the
// copies go out once those are read.
template <class C, typename T, class Rows, class IssuePrologue>
__device__ __forceinline__ void prepare_queries(QueryOperands<C>& q, const DecodeParams& p, const Rows& b,
                                                const QueryPieces<C>& pieces, const ScoreScale& sc, uint8_t* smem,
                                                IssuePrologue issue_prologue) {
  if (!p.hadamard) issue_prologue();
  fill_scale_lut<C>(reinterpret_cast<uint32_t*>(smem + C::kLutOffset));
  float* q_rot = reinterpret_cast<float*>(smem);
  if (p.hadamard) rotate_queries<C, T>(p, b, q_rot);
  build_query_operands<C, T>(q, p, b, pieces, q_rot);
  if (p.hadamard) {
    __syncthreads();  // q_rot is read; the pipeline may overwrite it
    issue_prologue();
  }
  scale_query_rows<C, T>(q, sc, b.c);
  store_query_operands<C>(q, smem, b);
}

}  // namespace decode
}  // namespace nvfp4
