// The decode kernel's epilogue: each warp's rows into the merge buffers, the token warps' rows merged
// and stored (as partial rows when the KV range is split), and in KV mode "hadamard" rotated back.
// Why each choice: docs/kernels.md#decode; why the steps take what they take:
// docs/kernels.md#decode-steps.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "decode_query.cuh"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// ------------------------------------------------------------------ step 6: the epilogue
// This warp's rows: full row sums, then its output rows, maxima and sums into its merge slots
// (merge_out [warps][rows][D], merge_ml [warps][rows][2], in the pipeline's buffers)
template <typename C>
__device__ __forceinline__ void store_warp_rows(uint8_t* smem, const float (&o_acc)[C::kRowTiles][C::kDTiles][4],
                                                const float (&row_max)[C::kRowTiles][2], const float (&row_sum)[C::kRowTiles][2],
                                                int row_warp, int token_warp, int g, int c) {
  constexpr int kHeadDim = C::kHeadDim;
  float* merge_out = reinterpret_cast<float*>(smem);
  float* merge_ml = merge_out + C::kTokenWarps * C::kMaxRows * kHeadDim;
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = row_sum[t][i];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      const int row = (row_warp * C::kRowTiles + t) * 8 + 2 * c + i;
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
}

// One thread's 8 consecutive elements d0.. of row `row` (one 16-byte store, two for fp32 partials),
// merged from the token warps that streamed the row's kv head (all of them unless the block packs
// heads; the others computed it against another head's keys, so they must not enter it, not even
// times 0: NaN * 0); o: the kernel's zeroed accumulator.  Every thread derives its row's weights
// itself: a pass of one warp over the rows, between two barriers, had kept the other warps waiting,
// and an element per thread and pass cost 8 passes of shared loads and 2-byte stores
// (docs/kernels.md#decode).  partial_row(row, head): the row's partial row index (split-KV).
template <typename C, typename T, typename PartialRow>
__device__ __forceinline__ void merge_piece(float (&o)[8], int row, int d0, const DecodeParams& p, const uint8_t* smem, float v_scale,
                                            int head_rows, int head_shift, int warp_head_shift, const PartialRow& partial_row,
                                            const Rows<C>& rows_of) {
  constexpr int kHeadDim = C::kHeadDim;
  const float* merge_out = reinterpret_cast<const float*>(smem);
  const float* merge_ml = merge_out + C::kTokenWarps * C::kMaxRows * kHeadDim;
  float* rot_rows = reinterpret_cast<float*>(const_cast<uint8_t*>(smem) + C::kRotOffset);  // KV mode "hadamard": [rows][D]
  const int head = row / head_rows;  // of the block's heads
  // the row in its warps' merge slots: the fused kernel's warps hold their head's rows only
  const int slot = C::kFused ? row - head * head_rows : row;
  auto live = [&](int w) { return (C::kFused ? w & ((1 << head_shift) - 1) : w >> warp_head_shift) == head; };
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < C::kTokenWarps; ++w)
    if (live(w)) m = fmaxf(m, merge_ml[(w * C::kMaxRows + slot) * 2]);
  const float base = m == -INFINITY ? 0.f : m;
  float l = 0.f;
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
      const float sink = __ldg(p.sinks + rows_of.q_head(row)) * kLog2e;
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
    *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + rows_of.offset(row, p.out_stride_token, p.out_stride_head) + d0) =
        make_uint4(pack2(o[0], o[1], T()), pack2(o[2], o[3], T()), pack2(o[4], o[5], T()), pack2(o[6], o[7], T()));
  }
}

// KV mode "hadamard": the merged rows rotated back, (P V H) H = P V, and stored
template <typename C, typename T, typename PartialRow>
__device__ __forceinline__ void rotate_back(const DecodeParams& p, uint8_t* smem, int rows, int head_rows,
                                            const PartialRow& partial_row, const Rows<C>& rows_of) {
  constexpr int kHeadDim = C::kHeadDim;
  float* rot_rows = reinterpret_cast<float*>(smem + C::kRotOffset);
  if (p.hadamard) {
    fwht_rows<kHeadDim, C::kThreads>(rot_rows, rows);
    for (int idx = threadIdx.x; idx < rows * kHeadDim; idx += C::kThreads) {
      const int row = idx / kHeadDim, d = idx % kHeadDim;
      const float value = rot_rows[row * kHeadDim + d] * p.hadamard_scale;
      if (p.num_splits > 1) {
        p.partial_out[partial_row(row, row / head_rows) * kHeadDim + d] = value;
      } else {
        store(static_cast<T*>(p.out) + rows_of.offset(row, p.out_stride_token, p.out_stride_head) + d, value);
      }
    }
  }
}

}  // namespace decode
}  // namespace nvfp4
