// The decode kernel's query steps: the block's query rows (Rows), the raw query loads, the Q^T operands
// built from them (rotated in KV mode "hadamard"), bf16 rows moved into fp16's range, and the operands'
// shared copy.  Why each choice: docs/kernels.md#decode; why the steps take what they take (plain
// values, the kernel's arrays, views of its locals): docs/kernels.md#decode-steps.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// Query row -> its query token, q head, and element offset in q or out.  The static kernel's warps
// hold all the block's rows, row r the token r / row_group (several heads: q_len 1); the fused
// kernel's warps hold their own head's rows, and a head's row r is query token r / group_size, q head
// r % group_size of the kv head.  A view of the kernel's locals (references, as a lambda captures).
template <typename C>
struct Rows {
  const DecodeParams& p;
  const int& head_rows;
  const int& row_group;
  const int& kv_base;
  const int& q_start;
  __device__ __forceinline__ int token(int row) const { return C::kFused ? row % head_rows / p.group_size : row / row_group; }
  __device__ __forceinline__ int q_head(int row) const {
    return C::kFused ? (kv_base + row / head_rows) * p.group_size + row % head_rows % p.group_size
                     : kv_base * p.group_size + row % row_group;
  }
  // the element offset of the row's (token, q head), given the strides of q or out
  __device__ __forceinline__ int64_t offset(int row, int64_t stride_token, int64_t stride_head) const {
    return (int64_t)(q_start + token(row)) * stride_token + (int64_t)q_head(row) * stride_head;
  }
};

// ------------------------------------------------------------------ step 1: load the queries
// Row n of row tile t is query row (row_warp, t, n) (the fused kernel: of the warp's head).  The raw
// query bits load first and become operands only after the first copies go out: issued after the
// copies, they waited behind that burst, and consumed before them, they held the copies back.  A
// thread's elements of a row are the D/4 from c * D/4: D/32 16-byte pieces (the binding requires
// 16-byte aligned rows), not 2-byte elements, which queued behind each other at the kernel's start
// (docs/kernels.md#decode).  KV mode "hadamard" takes the operands from its rotated rows instead and
// leaves q_raw zero.
template <typename C, typename T>
__device__ __forceinline__ void load_queries(uint4 (&q_raw)[C::kRowTiles][C::kQPieces], const DecodeParams& p,
                                             const Rows<C>& rows_of, int warp_row_base, int row_warp, int g, int c,
                                             int head_rows, int warp_head, int heads_here, int rows, int q_start, int row_group,
                                             int kv_base) {
  constexpr int kHeadDim = C::kHeadDim, kRowTiles = C::kRowTiles, kQPieces = C::kQPieces;
  if (!p.hadamard) {
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      const int row = C::kFused ? warp_row_base + t * 8 + g : (row_warp * kRowTiles + t) * 8 + g;
      const bool live = C::kFused ? t * 8 + g < head_rows && warp_head < heads_here : row < rows;
      // the row's offset only for a live row: it divides by head_rows, which is 0 for an empty
      // request.  The static kernels' form spelled out: Rows::offset compiles to another prologue there
      const uint4* qrow = reinterpret_cast<const uint4*>(
          C::kFused ? static_cast<const T*>(p.q) + (live ? rows_of.offset(row, p.q_stride_token, p.q_stride_head) : 0) + c * (kHeadDim / 4)
                    : static_cast<const T*>(p.q) + (int64_t)(q_start + (live ? row / row_group : 0)) * p.q_stride_token +
                          (int64_t)(kv_base * p.group_size + (live ? row % row_group : 0)) * p.q_stride_head + c * (kHeadDim / 4));
#pragma unroll
      for (int m = 0; m < kQPieces; ++m) q_raw[t][m] = live ? load_in_order(qrow + m) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// KV mode "hadamard": the block's query rows, rotated, in the (still unused) pipeline buffers as fp32
// (kMaxBlockRows x D x 4 bytes fit); rows past `rows` are zero
template <typename C, typename T>
__device__ __forceinline__ void rotate_queries(const DecodeParams& p, uint8_t* smem, int rows, const Rows<C>& rows_of) {
  constexpr int kHeadDim = C::kHeadDim;
  float* q_rot = reinterpret_cast<float*>(smem);
  if (p.hadamard) {
    for (int idx = threadIdx.x; idx < C::kMaxBlockRows * kHeadDim; idx += C::kThreads) {
      const int row = idx / kHeadDim, d = idx % kHeadDim;
      q_rot[idx] = row < rows ? to_float(static_cast<const T*>(p.q)[rows_of.offset(row, p.q_stride_token, p.q_stride_head) + d])
                              : 0.f;
    }
    fwht_rows<kHeadDim, C::kThreads>(q_rot, rows);  // rows past `rows` stay zero
  }
}

// The Q^T operands, once the first copies are out: k-step s, slot half holds elements e and e + 4
// (q_element), from q_raw or the rotated rows q_rot; and the cache positions of the thread's rows
// 2c, 2c+1 (or -1: no such row)
template <typename C, typename T, typename QElement>
__device__ __forceinline__ void query_operands(uint32_t (&q_frag)[C::kRowTiles][C::kKSteps][2], int (&row_pos)[C::kRowTiles][2],
                                               const uint4 (&q_raw)[C::kRowTiles][C::kQPieces], const DecodeParams& p,
                                               const float* q_rot, const QElement& q_element, const Rows<C>& rows_of,
                                               int warp_row_base, int row_warp, int g, int c, int head_rows, int rows, int seq_len,
                                               int q_len) {
  constexpr int kHeadDim = C::kHeadDim, kRowTiles = C::kRowTiles;
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
      row_pos[t][i] = live ? seq_len - q_len + rows_of.token(r) : -1;
    }
  }
}

// bf16 rows move into fp16 times 2^row_exp, which puts the row's largest magnitude in [2^14, 2^15)
// (maxima below 2^-113 take 2^127 and end lower, still exact); the softmax divides it out:
// score_scale of rows 2c, 2c+1 is (soft-cap ? qk_scale : qk_scale_log2) * 2^-row_exp (fp16 rows: 2^0)
template <typename C, typename T>
__device__ __forceinline__ void scale_query_rows(uint32_t (&q_frag)[C::kRowTiles][C::kKSteps][2], float (&score_scale)[C::kRowTiles][2],
                                                 bool soft_cap, float qk_scale, float qk_scale_log2) {
  constexpr int kRowTiles = C::kRowTiles;
  const int c = threadIdx.x % 32 & 3;
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
}

// Config::kQInSmem: the row warp's operands, stored by its first token warp (the fused kernel: one copy
// per kv head, stored by the head's first warp); read after the barrier before the tile loop
template <typename C>
__device__ __forceinline__ void share_query_operands(uint2* q_smem, const uint32_t (&q_frag)[C::kRowTiles][C::kKSteps][2], int lane,
                                                     int warp_rank, int token_warp) {
  if (C::kFused ? warp_rank == 0 : token_warp == 0) {
#pragma unroll
    for (int t = 0; t < C::kRowTiles; ++t)
#pragma unroll
      for (int s = 0; s < C::kKSteps; ++s) q_smem[(t * C::kKSteps + s) * 32 + lane] = make_uint2(q_frag[t][s][0], q_frag[t][s][1]);
  }
}

}  // namespace decode
}  // namespace nvfp4
