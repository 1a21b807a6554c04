// Dequantize pages into dense rows for the extend (prefill) path: one thread per 16-element
// block of one position and kv head of K or V (grid z); it reads 8 data bytes and one scale and
// writes 32 bytes.  The product e2m1 x e4m3 has at most 5 significant bits and lies in
// [2^-10, 2688], so the fp32 product converts to fp16 or bf16 exactly, as the reference's does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) gather_kv_kernel(const GatherKVParams p) {
  const int req = blockIdx.y;
  const bool is_v = blockIdx.z;
  const int blocks_per_head = p.head_dim / 16;
  const int per_pos = p.num_kv_heads * blocks_per_head;
  const int64_t flat = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const int pos = static_cast<int>(flat / per_pos);
  if (pos >= p.seq_lens[req]) return;
  const int head = static_cast<int>(flat % per_pos) / blocks_per_head, blk = static_cast<int>(flat % blocks_per_head);
  const int64_t page = p.block_table[(int64_t)req * p.block_table_stride + pos / p.page_size];
  const int in_page = pos % p.page_size;
  const int64_t data_off = page * p.data_strides.page + in_page * p.data_strides.token + head * p.data_strides.head;
  const int64_t scale_off = page * p.scale_strides.page + in_page * p.scale_strides.token + head * p.scale_strides.head;
  const uint2 codes = *reinterpret_cast<const uint2*>((is_v ? p.v_data : p.k_data) + data_off + blk * 8);
  const float scale = e4m3_value((is_v ? p.v_block_scales : p.k_block_scales)[scale_off + blk]);
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? codes.x : codes.y;
    const uint32_t byte = word >> (8 * (i % 4));  // elements 2i (low nibble) and 2i + 1
    out[i] = pack2(e2m1_value(byte & 0xFu) * scale, e2m1_value((byte >> 4) & 0xFu) * scale, T());
  }
  T* dst = static_cast<T*>(is_v ? p.v_out : p.k_out) +
           ((p.out_start[req] + pos) * p.num_kv_heads + head) * (int64_t)p.head_dim + blk * 16;
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(out[0], out[1], out[2], out[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace

cudaError_t launch_gather_kv(const GatherKVParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.max_seq_len == 0) return cudaSuccess;
  const int64_t threads = (int64_t)p.max_seq_len * p.num_kv_heads * (p.head_dim / 16);
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), p.batch, 2);
  if (p.dtype == QueryType::kBFloat16)
    gather_kv_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  else
    gather_kv_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace nvfp4
