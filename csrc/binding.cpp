// torch.library bindings: tensors -> params structs -> launchers.  Nothing numeric lives here.
#include <cmath>
#include <string>
#include <type_traits>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include "nvfp4_kernels.h"

namespace {

using at::Tensor;

// Error messages are assembled here with std::to_string and reach TORCH_CHECK as one C string, so
// no std::ostream of the extension's formats them: a toolchain that links libstdc++ statically into
// the extension (the H200 image's /opt/gcc does) leaves the process two copies of the iostream locale
// facets, and formatting a number through the extension's copy crashes instead of raising (seen
// 2026-11-30).  Each argument type has its own overload; any other type does not compile (at::IntArrayRef
// would otherwise take a double or an enum as a one-element array).
std::string text(const char* s) { return s; }
std::string text(const std::string& s) { return s; }
std::string text(c10::string_view s) { return std::string(s.data(), s.size()); }
std::string text(at::ScalarType t) { return c10::toString(t); }
std::string text(const at::Device& d) { return d.str(); }  // formatted inside libc10
template <typename T, std::enable_if_t<std::is_same_v<T, at::IntArrayRef>, int> = 0>
std::string text(const T& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
std::string text(T v) { return std::to_string(v); }
template <typename First, typename Second, typename... Rest>
std::string text(const First& first, const Second& second, const Rest&... rest) {
  return text(first) + text(second, rest...);
}
#define CHECK_ARG(cond, ...) TORCH_CHECK(cond, text(__VA_ARGS__).c_str())
// The CUDA guard's own check of a non-CUDA device formats through an ostream: check first
#define CHECK_CUDA(t) CHECK_ARG((t).is_cuda(), #t " must be a CUDA tensor, got ", (t).device())

nvfp4::QueryType query_type(const Tensor& t, const char* name) {
  CHECK_ARG(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? nvfp4::QueryType::kBFloat16 : nvfp4::QueryType::kFloat16;
}

nvfp4::PageStrides strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The decode kernel reads query rows and writes output rows ([tokens, heads, D]) in 16-byte pieces.
void check_rows_aligned(const Tensor& t, const char* name) {
  const int64_t pointer_offset = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16;
  bool aligned = pointer_offset == 0;
  for (int d = 0; d < 2; ++d) aligned = aligned && (t.size(d) <= 1 || t.stride(d) * t.element_size() % 16 == 0);
  CHECK_ARG(aligned, name, " rows must be 16-byte aligned (data pointer and token / head strides multiples of 16 bytes), "
            "got a data pointer ", pointer_offset, " bytes past a 16-byte boundary and strides ", t.strides());
}

// Device, dtype and shapes of the four cache views, K's and V's strides equal: what every kernel that
// reads the cache relies on (the alignment each one needs comes on top).
void check_cache_shapes(const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data, const Tensor& v_sf,
                        const at::Device& device) {
  for (const Tensor* t : {&k_data, &k_sf, &v_data, &v_sf}) {
    CHECK_ARG(t->device() == device, "cache tensors must be on ", device, ", got ", t->device());
    CHECK_ARG(t->scalar_type() == at::kByte && t->dim() == 4 && t->stride(3) == 1,
                "cache tensors must be 4-D uint8 with a contiguous last dimension");
  }
  // the kernels take the page count, page size, head count and head dim from k_data: a smaller scale
  // or V tensor would be written or read past its end
  CHECK_ARG(v_data.sizes() == k_data.sizes(), "v_data must have k_data's shape ", k_data.sizes(), ", got ",
            v_data.sizes());
  CHECK_ARG(k_sf.size(0) == k_data.size(0) && k_sf.size(1) == k_data.size(1) && k_sf.size(2) == k_data.size(2) &&
                k_sf.size(3) * 8 == k_data.size(3),
            "k_block_scales must be [pages, page_size, heads, head_dim / 16] = [", k_data.size(0), ", ",
            k_data.size(1), ", ", k_data.size(2), ", ", k_data.size(3) / 8, "] for k_data ", k_data.sizes(), ", got ",
            k_sf.sizes());
  CHECK_ARG(v_sf.sizes() == k_sf.sizes(), "v_block_scales must have k_block_scales' shape ", k_sf.sizes(), ", got ",
            v_sf.sizes());
  CHECK_ARG(k_data.strides() == v_data.strides(), "k_data and v_data must have identical strides");
  CHECK_ARG(k_sf.strides() == v_sf.strides(), "k_block_scales and v_block_scales must have identical strides");
}

// check_cache_shapes, plus what the writer and the decode kernel need: 16-byte data rows, 32-bit offsets.
void check_cache(const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data, const Tensor& v_sf,
                 const at::Device& device) {
  check_cache_shapes(k_data, k_sf, v_data, v_sf, device);
  const int64_t scale_bytes = k_sf.size(3);
  for (int d = 0; d < 3; ++d) {
    CHECK_ARG(k_data.stride(d) % 16 == 0, "k_data strides must be multiples of 16 bytes, got ", k_data.strides());
    CHECK_ARG(k_sf.stride(d) % scale_bytes == 0, "block-scale strides must be multiples of ", scale_bytes,
                " bytes, got ", k_sf.strides());
  }
  // the decode kernel and the writer compute offsets within a page, and page strides, in 32 bits
  CHECK_ARG(k_data.size(1) * k_data.stride(1) < (int64_t(1) << 31) && k_sf.size(1) * k_sf.stride(1) < (int64_t(1) << 31),
              "a cache page's tokens must span fewer than 2^31 bytes, got page_size ", k_data.size(1),
              " with token strides ", k_data.stride(1), " (data) and ", k_sf.stride(1), " (block scales)");
  CHECK_ARG(k_data.stride(0) < (int64_t(1) << 32) && k_sf.stride(0) < (int64_t(1) << 32),
              "cache page strides must be below 2^32 bytes, got ", k_data.stride(0), " (data) and ", k_sf.stride(0),
              " (block scales)");
  for (const Tensor* t : {&k_data, &v_data})
    CHECK_ARG(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "cache data must be 16-byte aligned");
  for (const Tensor* t : {&k_sf, &v_sf})
    CHECK_ARG(reinterpret_cast<uintptr_t>(t->data_ptr()) % scale_bytes == 0, "block scales must be ",
                scale_bytes, "-byte aligned");
}

// The cache fields every params struct shares (K/V data and scale pointers, their strides).
template <typename Params>
void set_cache(Params& p, const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data, const Tensor& v_sf) {
  p.k_data = k_data.data_ptr<uint8_t>();
  p.v_data = v_data.data_ptr<uint8_t>();
  p.k_block_scales = k_sf.data_ptr<uint8_t>();
  p.v_block_scales = v_sf.data_ptr<uint8_t>();
  p.data_strides = strides_of(k_data);
  p.scale_strides = strides_of(k_sf);
}

// The fields both attention ops' params share: q and out rows, the batch's index tensors, the
// global scales and the sinks.
template <typename Params>
void set_attention_io(Params& p, Tensor& out, const Tensor& q, const Tensor& block_table, const Tensor& seq_lens,
                      const Tensor& query_start_loc, const Tensor& k_global, const Tensor& v_global,
                      const std::optional<Tensor>& sinks) {
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.query_start_loc = query_start_loc.data_ptr<int>();
  p.k_global_scale = k_global.data_ptr<float>();
  p.v_global_scale = v_global.data_ptr<float>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
}

// KV mode "hadamard" for the writer and the decode kernel: the flag and format.hadamard_transform's
// multiplier float32(1/sqrt(D)), rounded from double as Python does.
template <typename Params>
void set_rotation(Params& p, c10::string_view rotation, int64_t head_dim) {
  CHECK_ARG(rotation == "none" || rotation == "hadamard", "rotation must be \"none\" or \"hadamard\", got ", rotation);
  p.hadamard = rotation == "hadamard";
  p.hadamard_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

int log2_exact(int64_t x, const char* name) {
  int l = 0;
  while ((int64_t(1) << l) < x) ++l;
  CHECK_ARG((int64_t(1) << l) == x, name, " must be a power of two, got ", x);
  return l;
}

void write_kv(const Tensor& key, const Tensor& value, const Tensor& slot_mapping, Tensor& k_data, Tensor& k_sf,
              Tensor& v_data, Tensor& v_sf, const Tensor& k_global, const Tensor& v_global,
              c10::string_view scale_rule, c10::string_view rotation) {
  CHECK_CUDA(key);
  const c10::cuda::CUDAGuard guard(key.device());
  check_cache(k_data, k_sf, v_data, v_sf, key.device());
  CHECK_ARG(key.sizes() == value.sizes() && key.strides() == value.strides() && key.dtype() == value.dtype(),
              "key and value must have the same shape, strides and dtype");
  CHECK_ARG(key.dim() == 3 && key.stride(2) == 1 && key.stride(0) % 8 == 0 && key.stride(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(key.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value.data_ptr()) % 16 == 0,
              "key/value must be [tokens, heads, head_dim], 16-byte aligned, strides multiples of 8");
  CHECK_ARG(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 tensor");
  // the kernel keeps a token-head's 16-element blocks on a power-of-two number of lanes, and its
  // index math is 32-bit: one thread per block of K or V, and slots (checked before narrowing)
  const int64_t tokens = key.size(0), heads = key.size(1), head_dim = key.size(2);
  CHECK_ARG(head_dim == 64 || head_dim == 128 || head_dim == 256,
              "write_kv's CUDA kernel takes head_dim 64, 128 or 256, got ", head_dim);
  CHECK_ARG(tokens * 2 * heads * (head_dim / 16) < (int64_t(1) << 31),
              "write_kv takes fewer than 2^31 / (2 * kv_heads * head_dim / 16) tokens per call, got ", tokens,
              " tokens of ", heads, " heads");
  CHECK_ARG(k_data.size(0) * k_data.size(1) < (int64_t(1) << 31), "write_kv needs fewer than 2^31 cache slots, got ",
              k_data.size(0) * k_data.size(1));
  nvfp4::WriteKVParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.kv_stride_token = key.stride(0);
  p.kv_stride_head = key.stride(1);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  set_cache(p, k_data, k_sf, v_data, v_sf);
  p.k_global_scale = k_global.data_ptr<float>();
  p.v_global_scale = v_global.data_ptr<float>();
  p.num_tokens = static_cast<int>(tokens);
  p.num_kv_heads = static_cast<int>(heads);
  p.head_dim = static_cast<int>(head_dim);
  p.page_size = k_data.size(1);
  p.num_slots = k_data.size(0) * k_data.size(1);
  p.dtype = query_type(key, "key");
  CHECK_ARG(scale_rule == "6" || scale_rule == "6or4", "scale_rule must be \"6\" or \"6or4\", got ", scale_rule);
  p.scale_rule = scale_rule == "6or4" ? nvfp4::ScaleRule::kSixOrFour : nvfp4::ScaleRule::kSix;
  set_rotation(p, rotation, p.head_dim);
  const cudaError_t err = nvfp4::launch_write_kv(p, c10::cuda::getCurrentCUDAStream(key.device().index()));
  CHECK_ARG(err == cudaSuccess, "nvfp4 write_kv launch failed: ", cudaGetErrorString(err));
}

// check_cache_shapes with the lighter alignment the prefill kernel and the dequantizer need: 4-byte
// pieces of data rows, whole scale rows, any page size, 64-bit offsets: every layout, vLLM's inline
// pages of any shape included
void check_cache_pieces(const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data, const Tensor& v_sf,
                        const at::Device& device, const char* op) {
  check_cache_shapes(k_data, k_sf, v_data, v_sf, device);
  const int64_t scale_bytes = k_sf.size(3);
  for (const Tensor* t : {&k_data, &v_data})
    CHECK_ARG(reinterpret_cast<uintptr_t>(t->data_ptr()) % 4 == 0 && t->stride(0) % 4 == 0 && t->stride(1) % 4 == 0 &&
                  t->stride(2) % 4 == 0,
              op, " reads cache data in 4-byte pieces: pointers and strides must be multiples of 4");
  for (const Tensor* t : {&k_sf, &v_sf})
    CHECK_ARG(reinterpret_cast<uintptr_t>(t->data_ptr()) % scale_bytes == 0 && t->stride(0) % scale_bytes == 0 &&
                  t->stride(1) % scale_bytes == 0 && t->stride(2) % scale_bytes == 0,
              "block-scale pointers and strides must be multiples of ", scale_bytes, " bytes, got strides ", t->strides());
}

// Checks shared by the attention ops: q and out rows, the index tensors.
void check_attention_io(const Tensor& out, const Tensor& q, const Tensor& block_table, const Tensor& seq_lens,
                        const Tensor& query_start_loc) {
  CHECK_ARG(out.sizes() == q.sizes() && out.dtype() == q.dtype() && out.stride(2) == 1, "out must match q");
  check_rows_aligned(q, "q");
  check_rows_aligned(out, "out");
  CHECK_ARG(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous() && block_table.stride(1) == 1,
              "block_table, seq_lens and query_start_loc must be int32 (contiguous rows)");
}

void paged_prefill(Tensor& out, const Tensor& q, const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data,
                   const Tensor& v_sf, const Tensor& block_table, const Tensor& seq_lens, const Tensor& query_start_loc,
                   const Tensor& k_global, const Tensor& v_global, double softmax_scale, int64_t sliding_window,
                   double logits_soft_cap, const std::optional<Tensor>& sinks, int64_t min_query_len,
                   c10::string_view rotation) {
  CHECK_CUDA(q);
  const c10::cuda::CUDAGuard guard(q.device());
  check_cache_pieces(k_data, k_sf, v_data, v_sf, q.device(), "paged_prefill");
  check_attention_io(out, q, block_table, seq_lens, query_start_loc);
  const int head_dim = q.size(2), num_kv_heads = k_data.size(2), group = q.size(1) / num_kv_heads;
  const int rows = nvfp4::prefill_rows(head_dim);  // 0: a head dim the kernel is not built for
  CHECK_ARG(rows > 0, "paged_prefill takes head_dim 64, 128 or 256, got ", head_dim);
  CHECK_ARG(group >= 1 && group <= rows && group * num_kv_heads == q.size(1), "q's ", q.size(1),
            " heads must be a multiple (at most ", rows, "x at head_dim ", head_dim, ") of the cache's ", num_kv_heads,
            " kv heads");
  nvfp4::PrefillParams p{};
  set_attention_io(p, out, q, block_table, seq_lens, query_start_loc, k_global, v_global, sinks);
  set_cache(p, k_data, k_sf, v_data, v_sf);
  p.softmax_scale = softmax_scale;
  p.logits_soft_cap = logits_soft_cap;
  p.sliding_window = sliding_window;
  set_rotation(p, rotation, head_dim);
  p.batch = seq_lens.size(0);
  p.num_kv_heads = num_kv_heads;
  p.group_size = group;
  p.head_dim = head_dim;
  p.page_size = k_data.size(1);
  p.tile_tokens = rows / group;
  const int64_t num_tiles = q.size(0) / p.tile_tokens + p.batch;  // room for every request's tiles
  CHECK_ARG(num_tiles * num_kv_heads < (int64_t(1) << 31), "paged_prefill takes fewer than 2^31 blocks (query tiles x kv heads), got ",
            num_tiles * num_kv_heads);
  p.num_tiles = static_cast<int>(num_tiles);
  p.min_query_len = static_cast<int>(std::max<int64_t>(min_query_len, 1));
  p.dtype = query_type(q, "q");
  const cudaError_t err = nvfp4::launch_paged_prefill(p, c10::cuda::getCurrentCUDAStream(q.device().index()));
  CHECK_ARG(err == cudaSuccess, "nvfp4 paged_prefill launch failed: ", cudaGetErrorString(err));
}

void paged_attention(Tensor& out, const Tensor& q, const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data,
                     const Tensor& v_sf, const Tensor& block_table, const Tensor& seq_lens,
                     const Tensor& query_start_loc, const Tensor& k_global, const Tensor& v_global,
                     double softmax_scale, int64_t sliding_window, double logits_soft_cap,
                     const std::optional<Tensor>& sinks, int64_t max_query_len, int64_t num_splits, Tensor& workspace,
                     c10::string_view rotation, int64_t heads_per_block, bool fused) {
  CHECK_CUDA(q);
  const c10::cuda::CUDAGuard guard(q.device());
  check_cache(k_data, k_sf, v_data, v_sf, q.device());
  const int head_dim = q.size(2), num_kv_heads = k_data.size(2), group = q.size(1) / num_kv_heads;
  const int64_t batch = seq_lens.size(0), max_rows = max_query_len * group;
  CHECK_ARG(max_rows > 0 && max_rows <= nvfp4::decode_max_rows(head_dim), "max_query_len * group_size = ",
              max_rows, " exceeds the decode kernel's ", nvfp4::decode_max_rows(head_dim), " rows at head_dim ",
              head_dim);
  check_attention_io(out, q, block_table, seq_lens, query_start_loc);
  CHECK_ARG(num_splits >= 1 && num_splits <= nvfp4::kMaxSplits, "num_splits must lie in [1, ", nvfp4::kMaxSplits,
              "], got ", num_splits);
  CHECK_ARG(heads_per_block == 1 || heads_per_block == 2 || heads_per_block == 4 || (fused && heads_per_block == 8),
              "heads_per_block must be 1, 2 or 4 (or 8 with fused), got ", heads_per_block);
  const int heads_per_block_log2 = heads_per_block == 8 ? 3 : heads_per_block == 4 ? 2 : heads_per_block == 2 ? 1 : 0;
  if (fused) {
    CHECK_ARG(nvfp4::decode_fused_ok(heads_per_block_log2, max_rows, head_dim), "fused needs head_dim 64 or 128 and ",
              "max_query_len * group_size <= 16 (heads_per_block <= 8 up to 8 rows, <= 4 up to 16), got head_dim ",
              head_dim, ", ", max_rows, " rows and heads_per_block ", heads_per_block);
  } else {
    CHECK_ARG(nvfp4::decode_heads_per_block_ok(heads_per_block_log2, max_rows, group),
              "heads_per_block ", heads_per_block, " needs max_query_len 1 and heads_per_block * group_size <= 8, got ",
              "max_query_len ", max_query_len, " and group_size ", group);
  }
  const int64_t partial_floats = batch * num_kv_heads * num_splits * max_rows;
  if (num_splits > 1) {
    CHECK_ARG(workspace.numel() >= partial_floats * (head_dim + 2) * 4, "workspace too small: ",
                workspace.numel(), " bytes, need ", partial_floats * (head_dim + 2) * 4);
    CHECK_ARG(reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 16 == 0, "workspace must be 16-byte aligned");
  }
  nvfp4::DecodeParams p{};
  set_attention_io(p, out, q, block_table, seq_lens, query_start_loc, k_global, v_global, sinks);
  set_cache(p, k_data, k_sf, v_data, v_sf);
  float* ws = reinterpret_cast<float*>(workspace.data_ptr());
  p.partial_out = ws;
  p.partial_max = ws + partial_floats * head_dim;
  p.partial_sum = p.partial_max + partial_floats;
  p.softmax_scale = softmax_scale;
  p.logits_soft_cap = logits_soft_cap;
  p.sliding_window = sliding_window;
  set_rotation(p, rotation, head_dim);
  p.batch = batch;
  p.num_kv_heads = num_kv_heads;
  p.group_size = group;
  p.head_dim = head_dim;
  p.page_size_log2 = log2_exact(k_data.size(1), "page_size");
  p.num_splits = num_splits;
  p.max_rows = max_rows;
  p.heads_per_block_log2 = heads_per_block_log2;
  p.fused_warps = fused ? nvfp4::decode_fused_warps(max_rows) : 0;
  p.dtype = query_type(q, "q");
  if (batch == 0) return;
  const cudaError_t err = nvfp4::launch_paged_decode(p, c10::cuda::getCurrentCUDAStream(q.device().index()));
  CHECK_ARG(err == cudaSuccess, "nvfp4 paged_attention launch failed: ", cudaGetErrorString(err));
}

// The segments of a prefill plan, dequantized into k_out / v_out ([rows, kv heads, head_dim], the rows
// the plan's segment table covers).  segments: int32 [3, num_segments + 1]: each segment's first
// workspace row (then the total), its request and its first cache position.
void dequantize_kv(Tensor& k_out, Tensor& v_out, const Tensor& k_data, const Tensor& k_sf, const Tensor& v_data,
                   const Tensor& v_sf, const Tensor& block_table, const Tensor& segments, const Tensor& k_global,
                   const Tensor& v_global) {
  CHECK_CUDA(k_out);
  const c10::cuda::CUDAGuard guard(k_out.device());
  check_cache_pieces(k_data, k_sf, v_data, v_sf, k_out.device(), "dequantize_kv");
  const int64_t num_kv_heads = k_data.size(2), head_dim = k_data.size(3) * 2;
  for (const Tensor* t : {&k_out, &v_out})
    CHECK_ARG(t->device() == k_out.device() && t->dim() == 3 && t->size(1) == num_kv_heads && t->size(2) == head_dim &&
                  t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
              "k_out and v_out must be contiguous, 16-byte aligned [rows, ", num_kv_heads, ", ", head_dim, "], got ",
              t->sizes());
  CHECK_ARG(v_out.sizes() == k_out.sizes() && v_out.scalar_type() == k_out.scalar_type(), "v_out must match k_out");
  CHECK_ARG(k_out.size(0) < (int64_t(1) << 31), "dequantize_kv takes fewer than 2^31 rows, got ", k_out.size(0));
  CHECK_ARG(segments.device() == k_out.device() && segments.scalar_type() == at::kInt && segments.dim() == 2 &&
                segments.size(0) == 3 && segments.size(1) >= 1 && segments.is_contiguous(),
            "segments must be a contiguous int32 [3, num_segments + 1] tensor on ", k_out.device(), ", got ",
            segments.sizes());
  CHECK_ARG(block_table.device() == k_out.device() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                block_table.stride(1) == 1,
            "block_table must be int32 [batch, max_pages] with contiguous rows");
  nvfp4::DequantizeKVParams p{};
  set_cache(p, k_data, k_sf, v_data, v_sf);
  p.block_table = block_table.data_ptr<int>();
  p.block_table_stride = block_table.stride(0);
  const int* table = segments.data_ptr<int>();
  const int64_t width = segments.size(1);
  p.segment_rows = table;
  p.segment_request = table + width;
  p.segment_position = table + 2 * width;
  p.num_segments = static_cast<int>(width - 1);
  p.k_global_scale = k_global.data_ptr<float>();
  p.v_global_scale = v_global.data_ptr<float>();
  p.k_out = k_out.data_ptr();
  p.v_out = v_out.data_ptr();
  p.num_rows = static_cast<int>(k_out.size(0));
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.page_size = static_cast<int>(k_data.size(1));
  p.dtype = query_type(k_out, "k_out");
  const cudaError_t err = nvfp4::launch_dequantize_kv(p, c10::cuda::getCurrentCUDAStream(k_out.device().index()));
  CHECK_ARG(err == cudaSuccess, "nvfp4 dequantize_kv launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(nvfp4_backend_C, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) k_data, Tensor(b!) k_block_scales, "
        "Tensor(c!) v_data, Tensor(d!) v_block_scales, Tensor k_global_scale, Tensor v_global_scale, "
        "str scale_rule, str rotation) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
        "Tensor v_block_scales, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor k_global_scale, Tensor v_global_scale, float softmax_scale, int sliding_window, "
        "float logits_soft_cap, Tensor? sinks, int max_query_len, int num_splits, Tensor(b!) workspace, "
        "str rotation, int heads_per_block=1, bool fused=False) -> ()");
  m.def("paged_prefill(Tensor(a!) out, Tensor q, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
        "Tensor v_block_scales, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
        "Tensor k_global_scale, Tensor v_global_scale, float softmax_scale, int sliding_window, "
        "float logits_soft_cap, Tensor? sinks, int min_query_len, str rotation) -> ()");
  m.def("dequantize_kv(Tensor(a!) k_out, Tensor(b!) v_out, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
        "Tensor v_block_scales, Tensor block_table, Tensor segments, Tensor k_global_scale, Tensor v_global_scale) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(nvfp4_backend_C, CUDA, m) {
  m.impl("write_kv", &write_kv);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_attention", &paged_attention);
  m.impl("dequantize_kv", &dequantize_kv);
}
