// The decode kernel's loop body: the running softmax state of a thread's rows, and one softmax step
// over a warp's 16-token sub-tiles as its scores (S^T = K Q^T), the online softmax, and the values
// (O^T += V^T P^T).  Why each choice: docs/kernels.md#decode; why the steps work on the kernel's
// arrays (the *Arrays structs) instead of their own: docs/kernels.md#decode-steps.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// The running softmax state of the thread's rows 2c, 2c+1 of each row tile: no row maximum yet, a
// zero sum and output
template <typename C>
__device__ __forceinline__ void start_rows(float (&o_acc)[C::kRowTiles][C::kDTiles][4], float (&row_max)[C::kRowTiles][2],
                                           float (&row_sum)[C::kRowTiles][2]) {
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) row_max[t][i] = -INFINITY, row_sum[t][i] = 0.f;
#pragma unroll
    for (int d = 0; d < C::kDTiles; ++d)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[t][d][i] = 0.f;
  }
}

// Each step's working arrays, declared by the kernel where its loop body declared them, fields in
// reverse order of first use (docs/kernels.md#decode-steps says why)
template <typename C>
struct ScoreArrays {
  uint32_t pb[4], pa[4], kwb[C::kKChunk / 4], kwa[C::kKChunk / 4];  // unpacked and raw K words of tokens a, b
};
template <typename C>
struct SoftmaxArrays {
  float p_val[4], m_new[2], x[C::kTilesPerStep][4];  // weights, new row maxima, scaled scores
};
template <typename C>
struct ValueArrays {
  uint32_t p23[8], p01[8], sv[4], vw[4][C::kVChunk / 4];  // unpacked V pairs, block scales, raw V words
};

// ------------------------------------------------------------------ step 3: the scores
// S^T = K Q^T for the softmax step's sub-tiles first .. first + kTilesPerStep - 1 (sub-tile j at
// stage_of(j), the warp's sub_of(j)-th of its stage): K dequantized in registers (unpack_word, then one
// packed multiply by the block scale from the scale table), the Q^T operands from registers or, with
// Config::kQInSmem, from shared memory
template <typename C, typename StageOf, typename SubOf>
__device__ __forceinline__ void tile_scores(float (&s_acc)[C::kTilesPerStep][C::kRowTiles][4], ScoreArrays<C>& r,
                                            const StageOf& stage_of, const SubOf& sub_of, int first, int k_off_a, int k_off_b,
                                            int ks_off_a, int ks_off_b, const uint32_t* scale_lut, const uint2* q_smem,
                                            const uint32_t (&q_frag)[C::kRowTiles][C::kKSteps][2]) {
  const int lane = threadIdx.x % 32;
  constexpr int kSubData = C::data_offset(16), kSubScale = 16 * C::kScaleBytes;
#pragma unroll
  for (int j = 0; j < C::kTilesPerStep; ++j) {
    const uint8_t* stage = stage_of(first + j);
    const int sub = sub_of(first + j);
    const uint8_t* k_data = stage + sub * kSubData;
    const uint8_t* k_scales = stage + 2 * C::kDataStage + sub * kSubScale;
#pragma unroll
    for (int t = 0; t < C::kRowTiles; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) s_acc[j][t][i] = 0.f;
#pragma unroll
    for (int w = 0; w < C::kKChunk / 4; w += 2) {
      *reinterpret_cast<uint2*>(&r.kwa[w]) = *reinterpret_cast<const uint2*>(k_data + k_off_a + 4 * w);
      *reinterpret_cast<uint2*>(&r.kwb[w]) = *reinterpret_cast<const uint2*>(k_data + k_off_b + 4 * w);
    }
#pragma unroll
    for (int blk = 0; blk < C::kKChunk / 8; ++blk) {  // one E4M3 scale per 8 bytes
      const uint32_t sa = scale_lut[k_scales[ks_off_a + blk]];
      const uint32_t sb = scale_lut[k_scales[ks_off_b + blk]];
#pragma unroll
      for (int w2 = 0; w2 < 2; ++w2) {
        const int w = blk * 2 + w2;
        unpack_word(r.kwa[w], r.pa);
        unpack_word(r.kwb[w], r.pb);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // two k-steps per word
          const int s = 2 * w + h;
          const uint32_t a[4] = {mul2(r.pa[2 * h], sa), mul2(r.pb[2 * h], sb), mul2(r.pa[2 * h + 1], sa),
                                 mul2(r.pb[2 * h + 1], sb)};
#pragma unroll
          for (int t = 0; t < C::kRowTiles; ++t) {
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
}

// ------------------------------------------------------------------ step 4: the online softmax
// The step's scores -> the P^T operands p_frag, the rows' maxima, sums and outputs rescaled where a
// maximum grew.  Masks are needed only where a sub-tile crosses the end of the range or a query row's
// position, or with a window (pos0: the sub-tiles' first positions; rows past `rows` may then hold
// scores, but they are never stored).
template <typename C, typename SubOf>
__device__ __forceinline__ void online_softmax(uint32_t (&p_frag)[C::kTilesPerStep][C::kRowTiles][2], int (&pos0)[C::kTilesPerStep],
                                               bool (&masked)[C::kTilesPerStep], SoftmaxArrays<C>& r,
                                               const float (&s_acc)[C::kTilesPerStep][C::kRowTiles][4],
                                               float (&o_acc)[C::kRowTiles][C::kDTiles][4], float (&row_max)[C::kRowTiles][2],
                                               float (&row_sum)[C::kRowTiles][2], const float (&score_scale)[C::kRowTiles][2],
                                               const int (&row_pos)[C::kRowTiles][2], const DecodeParams& p, const SubOf& sub_of,
                                               int tile, int first, int chunk_cur, int begin, int end, int first_qpos, int tile_shift,
                                               int sub_mask, bool soft_cap, int ka, int kb) {
  constexpr int kJ = C::kTilesPerStep;
  auto& x = r.x;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    pos0[j] = C::kFused ? begin + (chunk_cur << 5) + 16 * j
                        : begin + ((tile + (first + j) / C::kSubTiles) << tile_shift) + (sub_of(first + j) & sub_mask) * 16;
    masked[j] = pos0[j] + 15 >= end || pos0[j] + 15 > first_qpos || p.sliding_window > 0;
  }
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) x[j][i] = s_acc[j][t][i] * score_scale[t][i & 1];
    // one uniform branch for the scores: a branch per score (what nvcc made of a test inside the
    // loop) cost four taken jumps per 16 tokens without a cap, each an instruction-fetch stall
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
    bool grow = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float m = fmaxf(x[0][i], x[0][i + 2]);
#pragma unroll
      for (int j = 1; j < kJ; ++j) m = fmaxf(m, fmaxf(x[j][i], x[j][i + 2]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      r.m_new[i] = fmaxf(row_max[t][i], m);
      grow |= r.m_new[i] != row_max[t][i];
    }
    // rescale only when a row's running maximum grew (else alpha would be exactly 1)
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float alpha = fast_exp2(row_max[t][i] - (r.m_new[i] == -INFINITY ? 0.f : r.m_new[i]));
        row_max[t][i] = r.m_new[i];
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
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float base = (row_max[t][i] == -INFINITY ? 0.f : row_max[t][i]) - kWeightBiasLog2;
        r.p_val[i] = fast_exp2(x[j][i] - base);
        r.p_val[i + 2] = fast_exp2(x[j][i + 2] - base);
        row_sum[t][i] = row_sum[t][i] + r.p_val[i] + r.p_val[i + 2];
      }
      // S^T fragment (tokens x rows) -> P^T operand (k = tokens, n = rows)
      p_frag[j][t][0] = transpose8x8(pack2(r.p_val[0], r.p_val[1], __half()));
      p_frag[j][t][1] = transpose8x8(pack2(r.p_val[2], r.p_val[3], __half()));
    }
  }
}

// ------------------------------------------------------------------ step 5: the values
// O^T += V^T P^T, per sub-tile: thread c reads tokens 4c..4c+3 (v_off, vs_off), head-dim bytes from
// v_col = g * kVChunk; two tokens' bytes interleaved so each unpacked pair holds one head-dim index of
// both, then one packed multiply by their two block scales
template <typename C, typename StageOf, typename SubOf>
__device__ __forceinline__ void tile_values(float (&o_acc)[C::kRowTiles][C::kDTiles][4], ValueArrays<C>& r,
                                            const uint32_t (&p_frag)[C::kTilesPerStep][C::kRowTiles][2], const StageOf& stage_of,
                                            const SubOf& sub_of, int first, int v_off, int vs_off, const uint32_t* scale_lut, int v_col) {
  constexpr int kSubData = C::data_offset(16), kSubScale = 16 * C::kScaleBytes;
#pragma unroll
  for (int j = 0; j < C::kTilesPerStep; ++j) {
    const uint8_t* stage = stage_of(first + j);
    const int sub = sub_of(first + j);
    const uint8_t* v_data = stage + C::kDataStage + sub * kSubData;
    const uint8_t* v_scales = stage + 2 * C::kDataStage + C::kScaleStage + sub * kSubScale;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint8_t* src = v_data + v_off + k * C::kDataBytes;
      if constexpr (C::kVChunk == 4) r.vw[k][0] = *reinterpret_cast<const uint32_t*>(src);
      if constexpr (C::kVChunk == 8) *reinterpret_cast<uint2*>(r.vw[k]) = *reinterpret_cast<const uint2*>(src);
      if constexpr (C::kVChunk == 16) *reinterpret_cast<uint4*>(r.vw[k]) = *reinterpret_cast<const uint4*>(src);
    }
#pragma unroll
    for (int w = 0; w < C::kVChunk / 4; ++w) {
      const int sidx = (v_col + 4 * w) / 8;  // 8 bytes per block scale
#pragma unroll
      for (int k = 0; k < 4; ++k) r.sv[k] = scale_lut[v_scales[vs_off + k * C::kScaleBytes + sidx]];
      // {scale of token 0, of token 1}: the low halves of two {s, s} entries
      const uint32_t s01 = __byte_perm(r.sv[0], r.sv[1], 0x5410), s23 = __byte_perm(r.sv[2], r.sv[3], 0x5410);
      // interleave two tokens' bytes so each unpacked pair holds one head-dim index of both
      unpack_word(__byte_perm(r.vw[0][w], r.vw[1][w], 0x5410), *reinterpret_cast<uint32_t(*)[4]>(&r.p01[0]));
      unpack_word(__byte_perm(r.vw[0][w], r.vw[1][w], 0x7632), *reinterpret_cast<uint32_t(*)[4]>(&r.p01[4]));
      unpack_word(__byte_perm(r.vw[2][w], r.vw[3][w], 0x5410), *reinterpret_cast<uint32_t(*)[4]>(&r.p23[0]));
      unpack_word(__byte_perm(r.vw[2][w], r.vw[3][w], 0x7632), *reinterpret_cast<uint32_t(*)[4]>(&r.p23[4]));
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // 8 pairs -> 4 m-tiles of this word (2 head-dim rows each)
        const int d = w * 4 + q;
        const uint32_t a[4] = {mul2(r.p01[2 * q], s01), mul2(r.p01[2 * q + 1], s01), mul2(r.p23[2 * q], s23),
                               mul2(r.p23[2 * q + 1], s23)};
#pragma unroll
        for (int t = 0; t < C::kRowTiles; ++t) mma(o_acc[t][d], a, p_frag[j][t][0], p_frag[j][t][1]);
      }
    }
  }
}

}  // namespace decode
}  // namespace nvfp4
