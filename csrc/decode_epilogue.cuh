// The decode kernels' epilogue: each warp's rows into the merge buffers, the token warps merged per
// row, and the rows stored: normalized outputs, or unnormalized partial rows of a split (merged by
// merge_splits_kernel), rotated back first in KV mode "hadamard" (docs/kernels.md#decode).
#pragma once
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "decode_rows.cuh"
#include "decode_tile.cuh"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// The merge buffers, in the pipeline's shared memory: per token warp and row, the output row
// ([warps][rows][D]), its running maximum and sum ([warps][rows][2]).
template <class C>
struct MergeBuffers {
  float* out;
  float* ml;
  __device__ __forceinline__ explicit MergeBuffers(uint8_t* smem)
      : out(reinterpret_cast<float*>(smem)), ml(out + C::kTokenWarps * C::kMaxRows * C::kHeadDim) {}
};

// This warp's rows, with their full row sums, into its merge slots.
template <class C>
__device__ __forceinline__ void write_warp_rows(const MergeBuffers<C>& merge, const BlockPlace& b, const RowState<C>& st) {
#pragma unroll
  for (int t = 0; t < C::kRowTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = st.row_sum[t][i];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      const int row = (b.row_warp * C::kRowTiles + t) * 8 + 2 * b.c + i;
      float* out_row = merge.out + (b.token_warp * C::kMaxRows + row) * C::kHeadDim;
#pragma unroll
      for (int d = 0; d < C::kDTiles; ++d) {
        // m-tile d = word d/4, pair (d%4): rows g and g+8 are elements pair_element(2q), +4 ...
        const int w = d / 4, q = d % 4;
        const int base = b.g * (C::kHeadDim / 8) + 8 * w;
        const int e0 = (2 * q) < 4 ? pair_element(2 * q) : pair_element(2 * q - 4) + 4;
        const int e1 = (2 * q + 1) < 4 ? pair_element(2 * q + 1) : pair_element(2 * q + 1 - 4) + 4;
        out_row[base + e0] = st.o_acc[t][d][i];
        out_row[base + e1] = st.o_acc[t][d][i + 2];
      }
      if (b.g == 0) {
        merge.ml[(b.token_warp * C::kMaxRows + row) * 2 + 0] = st.row_max[t][i];
        merge.ml[(b.token_warp * C::kMaxRows + row) * 2 + 1] = l;
      }
    }
  }
}

// The row's partial row index (split-KV).
__device__ __forceinline__ int64_t partial_row(const DecodeParams& p, const BlockPlace& b, int row, int head) {
  const int64_t part = ((int64_t)b.req * p.num_kv_heads + b.kv_base + head) * p.num_splits + b.split;
  return part * p.max_rows + row - head * b.head_rows;
}

// two float4 stores: dst is 16-byte aligned (d0 is a multiple of 8, and the rows of the merge buffers
// and partial_out start 16-byte aligned: the binding checks the workspace's alignment)
__device__ __forceinline__ void store8(float* dst, const float (&o)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(o[4], o[5], o[6], o[7]);
}

// Elements d0 .. d0 + 7 of block row `row` merged over the token warps that streamed the row's kv head
// (all of them unless the block packs heads; the others computed it against another head's keys, so
// they must not enter it, not even times 0: NaN * 0): its maximum m, sum l and output o.
template <class C, class Rows>
__device__ __forceinline__ void merge_piece(float& m, float& l, float (&o)[8], const MergeBuffers<C>& merge, const Rows& b,
                                            int row, int head, int d0) {
  const int slot = b.merge_slot(row, head);  // the fused kernel's warps hold their head's rows only
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < C::kTokenWarps; ++w)
    if (b.streams(w, head)) m = fmaxf(m, merge.ml[(w * C::kMaxRows + slot) * 2]);
  const float base = m == -INFINITY ? 0.f : m;
  l = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = 0.f;
#pragma unroll
  for (int w = 0; w < C::kTokenWarps; ++w) {
    if (!b.streams(w, head)) continue;
    const float f = exp2f(merge.ml[(w * C::kMaxRows + slot) * 2] - base);
    l += f * merge.ml[(w * C::kMaxRows + slot) * 2 + 1];
    const float4* src = reinterpret_cast<const float4*>(merge.out + (w * C::kMaxRows + slot) * C::kHeadDim + d0);
    const float4 lo = src[0], hi = src[1];
    o[0] += f * lo.x, o[1] += f * lo.y, o[2] += f * lo.z, o[3] += f * lo.w;
    o[4] += f * hi.x, o[5] += f * hi.y, o[6] += f * hi.z, o[7] += f * hi.w;
  }
}

// Each thread finishes 8 consecutive elements of a row at a time (one 16-byte store, two for fp32
// partials).  Every thread derives its row's weights itself: a pass of one warp over the rows, between
// two barriers, had kept the other warps waiting, and an element per thread and pass cost 8 passes of
// shared loads and 2-byte stores at hd128.  In KV mode "hadamard" the rows are rotated back before they
// are stored: (P V H) H = P V, and the merge is linear in the rows.
template <class C, typename T, class Rows>
__device__ __forceinline__ void merge_and_store(const DecodeParams& p, const Rows& b, uint8_t* smem, float v_scale) {
  const MergeBuffers<C> merge(smem);
  constexpr int kPieces = C::kHeadDim / 8;  // a row's 8-element pieces
  // KV mode "hadamard": [rows][D].  In the static kernel, token warp 0's merge slot, whose elements
  // this thread alone read
  float* rot_rows = reinterpret_cast<float*>(smem + C::kRotOffset);
  for (int idx = threadIdx.x; idx < b.rows * kPieces; idx += C::kThreads) {
    const int row = idx / kPieces, d0 = idx % kPieces * 8;
    const int head = row / b.head_rows;  // of the block's heads
    float m, l, o[8];
    merge_piece<C>(m, l, o, merge, b, row, head, d0);
    const int64_t part_row = p.num_splits > 1 ? partial_row(p, b, row, head) : 0;
    if (p.num_splits > 1) {  // the partial rows stay unnormalized
      if (d0 == 0) p.partial_max[part_row] = m, p.partial_sum[part_row] = l;
    } else {
      if (p.sinks != nullptr) {
        const float sink = __ldg(p.sinks + b.q_head(p, row)) * kLog2e;
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
    if (p.hadamard) {
      store8(rot_rows + row * C::kHeadDim + d0, o);
    } else if (p.num_splits > 1) {
      store8(p.partial_out + part_row * C::kHeadDim + d0, o);
    } else {
      *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + row_offset(p, b, row, p.out_stride_token, p.out_stride_head) + d0) =
          make_uint4(pack2(o[0], o[1], T()), pack2(o[2], o[3], T()), pack2(o[4], o[5], T()), pack2(o[6], o[7], T()));
    }
  }
  if (p.hadamard) {
    fwht_rows<C::kHeadDim, C::kThreads>(rot_rows, b.rows);
    for (int idx = threadIdx.x; idx < b.rows * C::kHeadDim; idx += C::kThreads) {
      const int row = idx / C::kHeadDim, d = idx % C::kHeadDim;
      const float value = rot_rows[row * C::kHeadDim + d] * p.hadamard_scale;
      if (p.num_splits > 1) {
        p.partial_out[partial_row(p, b, row, row / b.head_rows) * C::kHeadDim + d] = value;
      } else {
        store(static_cast<T*>(p.out) + row_offset(p, b, row, p.out_stride_token, p.out_stride_head) + d, value);
      }
    }
  }
}

// The epilogue: the pipeline drained, its buffers become the merge buffers; the warps' rows are merged
// and stored.  The output scale's load goes out before the epilogue's barriers: loaded after them
// (where it is used), its latency stalled every block of a one-wave grid at once.
template <class C, typename T, class Rows>
__device__ __forceinline__ void epilogue(const DecodeParams& p, const Rows& b, uint8_t* smem, const RowState<C>& st) {
  const float v_scale = load_in_order(p.v_global_scale) * kDequantBias;
  cp_async_wait<0>();
  __syncthreads();
  write_warp_rows<C>(MergeBuffers<C>(smem), b, st);
  __syncthreads();
  merge_and_store<C, T>(p, b, smem, v_scale);
}

}  // namespace decode
}  // namespace nvfp4
