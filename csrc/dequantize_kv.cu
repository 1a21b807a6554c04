// The KV a prefill step reads, dequantized once into a 16-bit ragged workspace: rows of [num_kv_heads,
// head_dim] K and V, segment after segment, which a dense 16-bit attention kernel then reads
// (nvfp4_backend/dense_prefill.py runs FlashInfer's FA3 ragged prefill on it).  Every value is the
// cache's e2m1 x e4m3 product (exact in fp32) times the layer's global scale, rounded once to the
// query's dtype.  format.dequantize defines the same fp32 operations in the same order (the CPU op in
// dense_prefill.py), so the bytes match.  A Hadamard-mode cache takes the prefill kernel instead: its
// rows rotated back would round to 16 bits once more, beyond the accuracy bound on peaky attention.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace {

constexpr int kBlock = 16;     // elements per E4M3 block scale
constexpr int kThreads = 256;

// The segment that holds workspace row `row`: the last s with segment_rows[s] <= row.
__device__ __forceinline__ int find_segment(const int* segment_rows, int num_segments, int row) {
  int lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(segment_rows + mid) <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One 16-element block of one side: 8 data bytes (two 4-byte loads: the cache layouts guarantee
// 4-byte alignment only) and its scale byte -> 16 fp32 values times the global scale.
__device__ __forceinline__ void load_block(const uint8_t* data, const uint8_t* scale, float global, float (&vals)[kBlock]) {
  const uint32_t words[2] = {__ldg(reinterpret_cast<const uint32_t*>(data)),
                             __ldg(reinterpret_cast<const uint32_t*>(data) + 1)};
  const float block_scale = e4m3_value(__ldg(scale));
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {  // element 2j in the low nibble of byte j
    const uint32_t code = (words[i / 8] >> (4 * (i % 8))) & 0xFu;
    vals[i] = __fmul_rn(__fmul_rn(e2m1_value(code), block_scale), global);
  }
}

template <typename T>
__device__ __forceinline__ void store_block(T* dst, const float (&vals)[kBlock]) {
  const auto pair = [&](int i) { return pack2(vals[2 * i], vals[2 * i + 1], T()); };
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(pair(0), pair(1), pair(2), pair(3));
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(pair(4), pair(5), pair(6), pair(7));
}

// One thread per (workspace row, kv head, 16-element block), K and V both: neighbouring threads read
// neighbouring cache bytes and write neighbouring workspace bytes.  Each thread finds its segment by
// binary search over the plan's segment table, so one launch serves the whole ragged step.
template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_kv_kernel(const DequantizeKVParams p) {
  const int blocks_per_head = p.head_dim / kBlock;
  const int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int block = static_cast<int>(item % blocks_per_head);
  const int64_t row_head = item / blocks_per_head;
  const int head = static_cast<int>(row_head % p.num_kv_heads);
  const int64_t wanted_row = row_head / p.num_kv_heads;
  if (wanted_row >= p.num_rows) return;
  const int row = static_cast<int>(wanted_row);
  const int s = find_segment(p.segment_rows, p.num_segments, row);
  const int request = __ldg(p.segment_request + s);
  const int position = __ldg(p.segment_position + s) + (row - __ldg(p.segment_rows + s));
  const int page = __ldg(p.block_table + request * p.block_table_stride + position / p.page_size);
  const int slot = position % p.page_size;
  const int64_t data_offset = page * p.data_strides.page + slot * p.data_strides.token + head * p.data_strides.head +
                              block * (kBlock / 2);
  const int64_t scale_offset = page * p.scale_strides.page + slot * p.scale_strides.token +
                               head * p.scale_strides.head + block;
  float k[kBlock], v[kBlock];
  load_block(p.k_data + data_offset, p.k_block_scales + scale_offset, __ldg(p.k_global_scale), k);
  load_block(p.v_data + data_offset, p.v_block_scales + scale_offset, __ldg(p.v_global_scale), v);
  const int64_t out_offset = (int64_t(row) * p.num_kv_heads + head) * p.head_dim + block * kBlock;
  store_block(static_cast<T*>(p.k_out) + out_offset, k);
  store_block(static_cast<T*>(p.v_out) + out_offset, v);
}

template <typename T>
cudaError_t launch_typed(const DequantizeKVParams& p, int64_t grid, cudaStream_t stream) {
  dequantize_kv_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dequantize_kv(const DequantizeKVParams& p, cudaStream_t stream) {
  const int64_t items = int64_t(p.num_rows) * p.num_kv_heads * (p.head_dim / kBlock);
  if (items == 0 || p.num_segments == 0) return cudaSuccess;
  const int64_t grid = (items + kThreads - 1) / kThreads;
  return p.dtype == QueryType::kBFloat16 ? launch_typed<__nv_bfloat16>(p, grid, stream)
                                         : launch_typed<__half>(p, grid, stream);
}

}  // namespace nvfp4
