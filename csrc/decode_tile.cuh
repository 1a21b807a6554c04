// One softmax step of the decode kernels over a warp's 16-token sub-tiles in shared memory: the
// scores S^T = K Q^T, the online softmax, and O^T += V^T P^T (docs/kernels.md#decode).
#pragma once
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "decode_query.cuh"
#include "decode_rows.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// The running softmax state of a thread's rows (2c, 2c+1 of each row tile): the output accumulator
// O^T, the row maxima and the row sums.
template <class C>
struct RowState {
  float o_acc[C::kRowTiles][C::kDTiles][4];
  float row_max[C::kRowTiles][2], row_sum[C::kRowTiles][2];
  __device__ __forceinline__ RowState() {
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
};

// Where a thread reads a stage: its shared-memory offsets within the stage's first 16-token sub-tile
// (sub-tile k adds k * kSubData / kSubScale: data_offset is linear in steps of 16 rows).  Token kb is
// ka + 2, in the same padded group of 4 rows: b's offsets are a's plus constants.  V: thread c holds
// tokens 4c..4c+3 (one padded group of 4 rows), head-dim bytes [v_col, v_col + kVChunk), v_col = g * kVChunk.
template <class C>
struct TileReader {
  static constexpr int kSubData = C::data_offset(16), kSubScale = 16 * C::kScaleBytes;
  const uint8_t* smem;
  const uint32_t* scale_lut;
  int token_warp, lane, v_col;
  int ka, kb, k_off_a, k_off_b, ks_off_a, ks_off_b, v_off, vs_off;
  __device__ __forceinline__ TileReader(const BlockPlace& b, const uint8_t* smem_)
      : smem(smem_), scale_lut(reinterpret_cast<const uint32_t*>(smem_ + C::kLutOffset)), token_warp(b.token_warp),
        lane(b.lane), v_col(b.g * C::kVChunk), ka(tile_token(b.g)), kb(ka + 2),
        k_off_a(C::data_offset(ka) + b.c * C::kKChunk), k_off_b(k_off_a + 2 * C::kDataBytes),
        ks_off_a(ka * C::kScaleBytes + b.c * (C::kKChunk / 8)), ks_off_b(ks_off_a + 2 * C::kScaleBytes),
        v_off(C::data_offset(4 * b.c) + v_col), vs_off(4 * b.c * C::kScaleBytes) {}
  // a step's sub-tile j: this warp's sub-tile j % kSubTiles of stage tile + j / kSubTiles
  __device__ __forceinline__ const uint8_t* stage(int tile, int j) const {
    return smem + ((tile + j / C::kSubTiles) % kStages) * C::kStageBytes;
  }
  __device__ __forceinline__ int sub(int j) const { return token_warp + (j % C::kSubTiles) * C::kTokenWarps; }
};

// S^T = K Q^T for the step's kJ sub-tiles from sub-tile `first`.
template <class C, int kJ>
__device__ __forceinline__ void tile_scores(float (&s_acc)[kJ][C::kRowTiles][4], const TileReader<C>& r,
                                            const QueryOperands<C>& q, int tile, int first) {
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const uint8_t* stage = r.stage(tile, first + j);
    const int sub = r.sub(first + j);
    const uint8_t* k_data = stage + sub * r.kSubData;
    const uint8_t* k_scales = stage + 2 * C::kDataStage + sub * r.kSubScale;
#pragma unroll
    for (int t = 0; t < C::kRowTiles; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) s_acc[j][t][i] = 0.f;
    uint32_t kwa[C::kKChunk / 4], kwb[C::kKChunk / 4];
#pragma unroll
    for (int w = 0; w < C::kKChunk / 4; w += 2) {
      *reinterpret_cast<uint2*>(&kwa[w]) = *reinterpret_cast<const uint2*>(k_data + r.k_off_a + 4 * w);
      *reinterpret_cast<uint2*>(&kwb[w]) = *reinterpret_cast<const uint2*>(k_data + r.k_off_b + 4 * w);
    }
#pragma unroll
    for (int blk = 0; blk < C::kKChunk / 8; ++blk) {  // one E4M3 scale per 8 bytes
      const uint32_t sa = r.scale_lut[k_scales[r.ks_off_a + blk]];
      const uint32_t sb = r.scale_lut[k_scales[r.ks_off_b + blk]];
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
          for (int t = 0; t < C::kRowTiles; ++t) {
            if constexpr (C::kQInSmem) {
              const uint2 b = q.smem[(t * C::kKSteps + s) * 32 + r.lane];
              mma(s_acc[j][t], a, b.x, b.y);
            } else {
              mma(s_acc[j][t], a, q.frag[t][s][0], q.frag[t][s][1]);
            }
          }
        }
      }
    }
  }
}

// Online softmax over the step's sub-tiles: the scores scaled (and soft-capped) in log2 units, masked,
// the running maxima and sums updated, and the weights turned into the P^T operands.  Masks are needed
// only where a sub-tile crosses the end of the range or a query row's position, or with a window (then
// per element; rows past `rows` may hold scores, but they are never stored).  first_pos(j): the cache
// position of the step's sub-tile j's first token.
template <class C, int kJ, class FirstPos>
__device__ __forceinline__ void softmax_step(uint32_t (&p_frag)[kJ][C::kRowTiles][2], RowState<C>& st,
                                             const float (&s_acc)[kJ][C::kRowTiles][4], const DecodeParams& p,
                                             const ScoreScale& sc, const QueryOperands<C>& q, const TileReader<C>& r,
                                             int end, int first_qpos, FirstPos first_pos) {
  int pos0[kJ];
  bool masked[kJ];
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    pos0[j] = first_pos(j);
    masked[j] = pos0[j] + 15 >= end || pos0[j] + 15 > first_qpos || p.sliding_window > 0;
  }
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
    float x[kJ][4];
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) x[j][i] = s_acc[j][t][i] * q.score_scale[t][i & 1];
    // one uniform branch for the scores: a branch per score (what nvcc made of a test inside
    // the loop) cost four taken jumps per 16 tokens without a cap, each an instruction-fetch stall
    if (sc.soft_cap) {
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
          const int pos = pos0[j] + (i < 2 ? r.ka : r.kb);
          const int qpos = q.pos[t][i & 1];
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
      m_new[i] = fmaxf(st.row_max[t][i], m);
      grow |= m_new[i] != st.row_max[t][i];
    }
    // rescale only when a row's running maximum grew (else alpha would be exactly 1)
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float alpha = fast_exp2(st.row_max[t][i] - (m_new[i] == -INFINITY ? 0.f : m_new[i]));
        st.row_max[t][i] = m_new[i];
        st.row_sum[t][i] *= alpha;
#pragma unroll
        for (int d = 0; d < C::kDTiles; ++d) {
          st.o_acc[t][d][i] *= alpha;
          st.o_acc[t][d][i + 2] *= alpha;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      float p_val[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float base = (st.row_max[t][i] == -INFINITY ? 0.f : st.row_max[t][i]) - kWeightBiasLog2;
        p_val[i] = fast_exp2(x[j][i] - base);
        p_val[i + 2] = fast_exp2(x[j][i + 2] - base);
        st.row_sum[t][i] = st.row_sum[t][i] + p_val[i] + p_val[i + 2];
      }
      // S^T fragment (tokens x rows) -> P^T operand (k = tokens, n = rows)
      p_frag[j][t][0] = transpose8x8(pack2(p_val[0], p_val[1], __half()));
      p_frag[j][t][1] = transpose8x8(pack2(p_val[2], p_val[3], __half()));
    }
  }
}

// O^T += V^T P^T for the step's kJ sub-tiles from sub-tile `first`.
template <class C, int kJ>
__device__ __forceinline__ void accumulate_pv(RowState<C>& st, const uint32_t (&p_frag)[kJ][C::kRowTiles][2],
                                              const TileReader<C>& r, int tile, int first) {
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const uint8_t* stage = r.stage(tile, first + j);
    const int sub = r.sub(first + j);
    const uint8_t* v_data = stage + C::kDataStage + sub * r.kSubData;
    const uint8_t* v_scales = stage + 2 * C::kDataStage + C::kScaleStage + sub * r.kSubScale;
    uint32_t vw[4][C::kVChunk / 4];
#pragma unroll
    for (int row = 0; row < 4; ++row) {
      const uint8_t* src = v_data + r.v_off + row * C::kDataBytes;
      if constexpr (C::kVChunk == 4) vw[row][0] = *reinterpret_cast<const uint32_t*>(src);
      if constexpr (C::kVChunk == 8) *reinterpret_cast<uint2*>(vw[row]) = *reinterpret_cast<const uint2*>(src);
      if constexpr (C::kVChunk == 16) *reinterpret_cast<uint4*>(vw[row]) = *reinterpret_cast<const uint4*>(src);
    }
#pragma unroll
    for (int w = 0; w < C::kVChunk / 4; ++w) {
      const int sidx = (r.v_col + 4 * w) / 8;  // 8 bytes per block scale
      uint32_t sv[4];
#pragma unroll
      for (int row = 0; row < 4; ++row) sv[row] = r.scale_lut[v_scales[r.vs_off + row * C::kScaleBytes + sidx]];
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
        for (int t = 0; t < C::kRowTiles; ++t) mma(st.o_acc[t][d], a, p_frag[j][t][0], p_frag[j][t][1]);
      }
    }
  }
}

// One softmax step: the scores of the step's sub-tiles from sub-tile `first` (of the loop iteration's
// stages from `tile`), their softmax, and their weighted values.
template <class C, class FirstPos>
__device__ __forceinline__ void attend_step(RowState<C>& st, const TileReader<C>& r, const QueryOperands<C>& q,
                                            const DecodeParams& p, const ScoreScale& sc, const KvSplit& kv, int tile,
                                            int first, FirstPos first_pos) {
  constexpr int kJ = C::kTilesPerStep;  // sub-tiles of this softmax step
  float s_acc[kJ][C::kRowTiles][4];
  tile_scores<C, kJ>(s_acc, r, q, tile, first);
  uint32_t p_frag[kJ][C::kRowTiles][2];
  softmax_step<C, kJ>(p_frag, st, s_acc, p, sc, q, r, kv.end, kv.first_qpos, first_pos);
  accumulate_pv<C, kJ>(st, p_frag, r, tile, first);
}

}  // namespace decode
}  // namespace nvfp4
