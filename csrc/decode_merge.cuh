// The split-KV merge: one block per (query row, kv head, request) combines the unnormalized partial
// rows that the decode kernel's splits wrote (docs/kernels.md#decode).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include "decode_config.cuh"
#include "decode_primitives.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace decode {

// Combine the splits of one query row of one (request, kv head) per block.  Each group of kHeadDim / 4
// threads (float4 loads) folds its share of the splits into a running maximum, sum and output, eight
// splits per round, and the groups combine once in shared memory.  A round's loads are written
// before any use (ptxas still issues the outputs' loads after the first exp2f: two latencies per
// round); the former two passes, the splits' maximum and then their weights, cost three in a row.
// The block has as many groups as one round needs (at least a warp), up to kMergeMaxThreads: a full
// block for every row is slow where there are many rows of few splits.  Sums go in a fixed order, so
// results are run-to-run identical.
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
  const int request_rows = (p.query_start_loc[req + 1] - q_start) * p.group_size;
  const int rows = request_rows <= p.max_rows ? request_rows : 0;  // longer: not the decode kernel's (paged_decode_kernel)
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

}  // namespace decode
}  // namespace nvfp4
