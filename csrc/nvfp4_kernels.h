// nvfp4-backend kernel interface: params structs and launchers.  No torch includes here, so the
// kernels compile fast and for any arch; binding.cpp converts tensors into these structs.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

// The support limits (kMaxSplits, kHeadDims, kDecodeMaxRows, ...), generated at build time from
// nvfp4_backend/capabilities.py, the one place they are defined (nvfp4_backend/jit.py limits_header)
#include "nvfp4_limits.h"

namespace nvfp4 {

enum class QueryType : int { kFloat16 = 0, kBFloat16 = 1 };
// How the writer picks a block's E4M3 scale (format.SCALE_RULES: "6", "6or4").
enum class ScaleRule : int { kSix = 0, kSixOrFour = 1 };

// Strides, in bytes, of one strided view [num_pages, page_size, num_kv_heads, bytes].
struct PageStrides {
  int64_t page, token, head;
};

//! \brief Quantize-on-write: K/V [num_tokens, num_kv_heads, head_dim] -> NVFP4 pages.
struct WriteKVParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim] fp16/bf16, last dim contiguous
  const void* value;  // same shape and strides as key
  int64_t kv_stride_token, kv_stride_head;     // elements
  const int64_t* slot_mapping;                 // [num_tokens]; slot < 0 or >= num_slots: skipped
  uint8_t* k_data;  uint8_t* v_data;           // [pages, page_size, heads, head_dim/2]  E2M1x2
  uint8_t* k_block_scales; uint8_t* v_block_scales;  // [pages, page_size, heads, head_dim/16] E4M3
  PageStrides data_strides, scale_strides;     // shared by K and V (checked by the binding)
  const float* k_global_scale; const float* v_global_scale;  // device fp32 dequant multipliers
  int num_tokens, num_kv_heads, head_dim, page_size;
  int64_t num_slots;
  QueryType dtype;
  ScaleRule scale_rule;
  // KV mode "hadamard": quantize x H (format.hadamard_transform: fp32 butterflies, then one multiply
  // by hadamard_scale = float32(1/sqrt(head_dim)), rounded to the input dtype) instead of x
  bool hadamard;
  float hadamard_scale;
};

//! \brief Paged attention of ragged queries over an NVFP4 cache (decode, spec-decode, short extend).
struct DecodeParams {
  const void* q;  void* out;                   // [num_tokens, num_q_heads, head_dim] fp16/bf16
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;   // elements
  const uint8_t* k_data; const uint8_t* v_data;
  const uint8_t* k_block_scales; const uint8_t* v_block_scales;
  PageStrides data_strides, scale_strides;
  const int* block_table; int64_t block_table_stride;   // [batch, max_pages] page indices
  const int* seq_lens;                                  // [batch] cache positions per request
  const int* query_start_loc;                           // [batch + 1]
  const float* k_global_scale; const float* v_global_scale;
  const float* sinks;                                   // [num_q_heads] logits, or nullptr
  // partial_out and partial_sum both carry the decode kernel's 2^15 weight bias (it cancels)
  float* partial_out;   // [batch, kv_heads, num_splits, max_rows, head_dim] fp32 (num_splits > 1)
  float* partial_max;   // [batch, kv_heads, num_splits, max_rows] running max, log2 units
  float* partial_sum;   // [batch, kv_heads, num_splits, max_rows]
  float softmax_scale, logits_soft_cap;                 // soft cap 0 = off
  int sliding_window;                                   // 0 = off; else visible tokens incl. own
  int batch, num_kv_heads, group_size, head_dim, page_size_log2, num_splits;
  int max_rows;                                         // max_query_len * group_size
  // kv heads per thread block, log2: static kernels 0, 1, 2, more than one only with max_query_len 1
  // and group_size << heads_per_block_log2 <= 8 (decode_heads_per_block_ok); the fused kernel up to 3
  // (decode_fused_ok).  The partial rows stay per kv head
  int heads_per_block_log2;
  // the fused kernel (decode_fused_ok): one block of 16 warps (max_rows <= 8) or 12 (<= 16) serves
  // 1 << heads_per_block_log2 kv heads, a warp holding its own head's rows; 0: the other kernels
  int fused_warps;
  QueryType dtype;
  // KV mode "hadamard" (the cache holds k H, v H): q is rotated by H and the output rotated back
  // by H inside the kernel (fp32 butterflies, then one multiply by hadamard_scale = 1/sqrt(D))
  bool hadamard;
  float hadamard_scale;
};

//! \brief Paged attention of long ragged queries (prefill, chunked prefill) over an NVFP4 cache, in one
//! launch: blocks of prefill_rows() packed query rows (tokens x the group of q heads of one kv head) over
//! dequantized KV tiles.  The grid ((q tokens / tile_tokens + batch) x kv heads) needs no host lengths.
struct PrefillParams {
  const void* q;  void* out;                   // [num_tokens, num_q_heads, head_dim] fp16/bf16
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;   // elements
  const uint8_t* k_data; const uint8_t* v_data;
  const uint8_t* k_block_scales; const uint8_t* v_block_scales;
  PageStrides data_strides, scale_strides;
  const int* block_table; int64_t block_table_stride;   // [batch, max_pages] page indices
  const int* seq_lens;                                  // [batch] cache positions per request
  const int* query_start_loc;                           // [batch + 1]
  const float* k_global_scale; const float* v_global_scale;
  const float* sinks;                                   // [num_q_heads] logits, or nullptr
  float softmax_scale, logits_soft_cap;                 // soft cap 0 = off
  int sliding_window;                                   // 0 = off; else visible tokens incl. own
  int batch, num_kv_heads, group_size, head_dim, page_size;
  int tile_tokens;      // query tokens per block: prefill_rows(head_dim) / group_size
  int num_tiles;        // num_tokens / tile_tokens + batch (room for every request's tiles); x kv heads blocks
  int min_query_len;    // requests with fewer query tokens are left alone (the decode kernel serves them)
  QueryType dtype;
  bool hadamard;        // KV mode "hadamard": q rotated by H, the output rotated back (as DecodeParams)
  float hadamard_scale;
};

//! \brief The KV ranges a prefill step reads, dequantized into a 16-bit ragged workspace (K and V rows of
//! [num_kv_heads, head_dim]) for a dense attention kernel: one launch for every segment of the step.
struct DequantizeKVParams {
  const uint8_t* k_data; const uint8_t* v_data;
  const uint8_t* k_block_scales; const uint8_t* v_block_scales;
  PageStrides data_strides, scale_strides;
  const int* block_table; int64_t block_table_stride;   // [batch, max_pages] page indices
  // the plan's segment table: segment s fills workspace rows [segment_rows[s], segment_rows[s + 1])
  // with request segment_request[s]'s cache positions from segment_position[s] on
  const int* segment_rows;      // [num_segments + 1], rising from 0 to num_rows
  const int* segment_request;   // [num_segments] block_table rows
  const int* segment_position;  // [num_segments]
  const float* k_global_scale; const float* v_global_scale;
  void* k_out; void* v_out;     // [num_rows, num_kv_heads, head_dim] fp16/bf16, contiguous
  int num_segments, num_rows, num_kv_heads, head_dim, page_size;
  QueryType dtype;
};

cudaError_t launch_write_kv(const WriteKVParams& p, cudaStream_t stream);
cudaError_t launch_paged_decode(const DecodeParams& p, cudaStream_t stream);
cudaError_t launch_paged_prefill(const PrefillParams& p, cudaStream_t stream);
cudaError_t launch_dequantize_kv(const DequantizeKVParams& p, cudaStream_t stream);
//! Packed query rows (tokens x group size) one prefill thread block holds at a head dim: 128 up to
//! D 128 (two m16 row tiles per warp), 64 at D 256 (one).  The largest group it serves.
constexpr int prefill_rows(int head_dim) {
  for (int i = 0; i < int(sizeof(kHeadDims) / sizeof(kHeadDims[0])); ++i)
    if (kHeadDims[i] == head_dim) return kPrefillRows[i];
  return 0;
}
//! Largest max_rows the decode kernel serves for a head_dim (0 if the head_dim is unsupported).
constexpr int decode_max_rows(int head_dim) {
  for (int i = 0; i < int(sizeof(kHeadDims) / sizeof(kHeadDims[0])); ++i)
    if (kHeadDims[i] == head_dim) return kDecodeMaxRows[i];
  return 0;
}
//! Whether a block may serve 1 << heads_per_block_log2 kv heads: plain decode (max_rows ==
//! group_size, i.e. max_query_len 1) whose packed rows fit the one-row-tile kernel's 8.
bool decode_heads_per_block_ok(int heads_per_block_log2, int max_rows, int group_size);
//! Whether the fused kernel serves max_rows at head_dim with 1 << heads_per_block_log2 kv heads per
//! block: D <= 128, up to 8 rows (up to 8 heads) or 16 (up to 4 heads), any query length.
bool decode_fused_ok(int heads_per_block_log2, int max_rows, int head_dim);
//! The fused kernel's warps per block for max_rows (16 for one row tile, 12 for two).
constexpr int decode_fused_warps(int max_rows) { return max_rows <= kRowTile ? 16 : 12; }

}  // namespace nvfp4
