// The prefill kernel's MMA steps: one tile's scores, the online softmax, P V, and the epilogue.
#pragma once
#include "prefill_config.cuh"
#include "prefill_load.cuh"

namespace nvfp4 {
namespace prefill {

// ------------------------------------------------------------------ step 4: scores and softmax
// The warp's state for the thread's rows, thread_row(i) for i < 2 kRowTiles (row tile i / 2, MMA row
// lane / 4 + 8 (i % 2)): running maxima (log2 units) and sums, and the output accumulator (m16 x
// kHeadDim per row tile, the MMA's C layout).
template <typename C>
struct RowState {
  static constexpr int kThreadRows = 2 * C::kRowTiles;
  float o[C::kRowTiles][C::kHeadDim / 8][4];
  float max[kThreadRows], sum[kThreadRows];
  const float* logit_scale;  // [kRows] in shared memory (Config::kRowInfoOffset), log2 units
  const int* pos;            // [kRows]
};
template <typename C>
__device__ __forceinline__ int thread_row(int i) {
  return (threadIdx.x >> 5) * C::kWarpRows + (i >> 1) * 16 + ((threadIdx.x & 31) >> 2) + 8 * (i & 1);
}
template <typename C>
using Scores = float[C::kRowTiles][C::kTileTokens / 8][4];

// S = Q K^T for the warp's rows and the tile's positions (raw fp32 scores); each K fragment serves
// every row tile
template <typename C>
__device__ __forceinline__ void tile_scores(uint32_t q_rows, uint32_t k_tile, Scores<C>& s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt)
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[rt][nt][i] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < C::kHeadDim / 16; ++ks) {
    uint32_t a[C::kRowTiles][4];
#pragma unroll
    for (int rt = 0; rt < C::kRowTiles; ++rt)
      ldmatrix_x4(a[rt], q_rows + ((warp * C::kWarpRows + rt * 16 + (lane & 15)) * C::kPitch + ks * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; nt += 2) {
      uint32_t b[4];  // positions nt * 8.. and (nt + 1) * 8.., head dims ks * 16 + {0, 8}
      ldmatrix_x4(b, k_tile + (((nt + (m >> 1)) * 8 + (lane & 7)) * C::kPitch + ks * 16 + (m & 1) * 8) * 2);
#pragma unroll
      for (int rt = 0; rt < C::kRowTiles; ++rt) {
        mma(s[rt][nt], a[rt], b[0], b[1]);
        mma(s[rt][nt + 1], a[rt], b[2], b[3]);
      }
    }
  }
}

// Masks, soft-caps and exponentiates the tile's scores in place (the fp16 weights' inputs, x 2^15),
// updating the running maxima and sums and rescaling the output.
template <bool kMasked, bool kCapped, typename C>
__device__ __forceinline__ void online_softmax(const PrefillParams& p, RowState<C>& st, Scores<C>& s, int tile_start) {
  const int lane = threadIdx.x & 31;
  // the logit scale carries log2(e): x is the logit in log2 units, capped as cap * tanh(logit / cap)
  const float cap_log2 = p.logits_soft_cap * kLog2e, inv_cap_log2 = 1.0f / cap_log2;
#pragma unroll
  for (int h = 0; h < RowState<C>::kThreadRows; ++h) {
    const int rt = h >> 1, half = h & 1;
    const float logit_scale = st.logit_scale[thread_row<C>(h)];
    const int pos = st.pos[thread_row<C>(h)];
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float x = s[rt][nt][2 * half + j] * logit_scale;
        if constexpr (kCapped) x = cap_log2 * tanh_accurate(x * inv_cap_log2);
        if constexpr (kMasked) {
          const int kv = tile_start + nt * 8 + 2 * (lane & 3) + j;
          const bool visible = kv <= pos && (p.sliding_window <= 0 || kv > pos - p.sliding_window);
          x = visible ? x : -INFINITY;
        }
        s[rt][nt][2 * half + j] = x;
        tile_max = fmaxf(tile_max, x);
      }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(st.max[h], tile_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row that sees nothing yet stays 0
    const float rescale = fast_exp2(st.max[h] - base);
    st.max[h] = new_max;
    st.sum[h] *= rescale;
#pragma unroll
    for (int dt = 0; dt < C::kHeadDim / 8; ++dt) {
      st.o[rt][dt][2 * half] *= rescale;
      st.o[rt][dt][2 * half + 1] *= rescale;
    }
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float w = fast_exp2(s[rt][nt][2 * half + j] - base + kWeightBiasLog2);
        s[rt][nt][2 * half + j] = w;
        st.sum[h] += w;
      }
  }
}

// O += P V: the weights' C fragments of two position octets are the A fragment of one k step; each V
// fragment serves every row tile
template <typename C>
__device__ __forceinline__ void tile_values(RowState<C>& st, const Scores<C>& s, uint32_t v_tile) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int ks = 0; ks < C::kTileTokens / 16; ++ks) {
    uint32_t a[C::kRowTiles][4];
#pragma unroll
    for (int rt = 0; rt < C::kRowTiles; ++rt) {
      a[rt][0] = pack2(s[rt][2 * ks][0], s[rt][2 * ks][1], __half());
      a[rt][1] = pack2(s[rt][2 * ks][2], s[rt][2 * ks][3], __half());
      a[rt][2] = pack2(s[rt][2 * ks + 1][0], s[rt][2 * ks + 1][1], __half());
      a[rt][3] = pack2(s[rt][2 * ks + 1][2], s[rt][2 * ks + 1][3], __half());
    }
#pragma unroll
    for (int dt = 0; dt < C::kHeadDim / 8; dt += 2) {
      uint32_t b[4];  // positions ks * 16 + {0, 8}.., head dims dt * 8.. and (dt + 1) * 8..
      ldmatrix_x4_trans(b, v_tile + ((ks * 16 + (m & 1) * 8 + (lane & 7)) * C::kPitch + (dt + (m >> 1)) * 8) * 2);
#pragma unroll
      for (int rt = 0; rt < C::kRowTiles; ++rt) {
        mma(st.o[rt][dt], a[rt], b[0], b[1]);
        mma(st.o[rt][dt + 1], a[rt], b[2], b[3]);
      }
    }
  }
}

// ------------------------------------------------------------------ step 5: the epilogue
// Sinks join the denominator, the rows are normalized and staged in fp32 (head-dim order restored),
// then each row is rotated back by H (Hadamard mode) and stored by its warp, 16-byte pieces per lane.
template <typename T, typename C>
__device__ __forceinline__ void store_output(const PrefillParams& p, const Tile& t, RowState<C>& st, float* rows) {
  constexpr int E = C::kElementsPerLane;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float v_scale = *p.v_global_scale * kValueBias;
  // the warp's 32 rows at once, stored one row per lane (D <= 128 without rotation, as load_rows_by_lane
  // loads them); else one row tile at a time, each row stored by the warp
  constexpr bool kAllRows = C::kWarpRows == 32;
  const bool by_lane = kAllRows && !p.hadamard;
  float* warp_rows = rows + warp * (kAllRows ? 32 : 16) * C::kOutPitch;
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = 2 * rt + half, r = thread_row<C>(h);
      float sum = st.sum[h];  // the thread's columns: the row's four threads add theirs up
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      float out_scale = v_scale;
      if (p.sinks != nullptr && st.pos[r] >= 0) {  // one more logit in the denominator, weighed as the rest
        const float sink = p.sinks[t.kv_head * p.group_size + r % p.group_size] * kLog2e;
        const float new_max = fmaxf(st.max[h], sink);
        const float rescale = fast_exp2(st.max[h] - new_max);
        sum = sum * rescale + fast_exp2(sink - new_max + kWeightBiasLog2);
        out_scale *= rescale;
      }
      out_scale = sum > 0.0f ? out_scale / sum : 0.0f;
      float* row = warp_rows + ((by_lane ? 16 * rt : 0) + (lane >> 2) + 8 * half) * C::kOutPitch;
#pragma unroll
      for (int dt = 0; dt < C::kHeadDim / 8; ++dt)
#pragma unroll
        for (int j = 0; j < 2; ++j) row[dt * 8 + stored_at(2 * (lane & 3) + j)] = st.o[rt][dt][2 * half + j] * out_scale;
    }
    __syncwarp();
    if (by_lane) continue;
    for (int i = 0; i < 16; ++i) {
      const int r = warp * C::kWarpRows + rt * 16 + i, token = r / p.group_size;
      if (token >= t.tokens) break;  // rows past the tile's tokens: rows are token-major, none follow
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = warp_rows[i * C::kOutPitch + lane * E + j];
      if (p.hadamard) hadamard_row<E>(x, p.hadamard_scale);
      uint32_t w[E / 2];
#pragma unroll
      for (int j = 0; j < E / 2; ++j) w[j] = pack2(x[2 * j], x[2 * j + 1], T());
      T* dst = static_cast<T*>(p.out) + row_offset(p, t, r, p.out_stride_token, p.out_stride_head) + lane * E;
      if constexpr (E == 8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(w);
      if constexpr (E == 4) *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(w);
      if constexpr (E == 2) *reinterpret_cast<uint32_t*>(dst) = w[0];
    }
    __syncwarp();  // the next row tile overwrites the rows
  }
  if (by_lane) {
    const int r = threadIdx.x, token = r / p.group_size;
    if (token >= t.tokens) return;
    const float4* row = reinterpret_cast<const float4*>(warp_rows + lane * C::kOutPitch);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_offset(p, t, r, p.out_stride_token, p.out_stride_head));
#pragma unroll
    for (int k = 0; k < C::kHeadDim / 8; ++k) {
      const float4 a = row[2 * k], b = row[2 * k + 1];
      dst[k] = make_uint4(pack2(a.x, a.y, T()), pack2(a.z, a.w, T()), pack2(b.x, b.y, T()), pack2(b.z, b.w, T()));
    }
  }
}

}  // namespace prefill
}  // namespace nvfp4
