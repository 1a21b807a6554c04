// The binding's error messages on the host, without a GPU: csrc/binding.cpp is included whole (its
// checks live in an anonymous namespace), and so is the decode dispatch (csrc/paged_decode.cu, plain
// host C++: its heads-per-block and fused rules, on the generated limits header that the test
// writes); the kernel launchers are stubs that must not be reached, and the CUDA headers binding.cpp
// needs from torch come from c10_cuda_stub/.  Prints "ok: N checks" or the first mismatch (exit 1).
// Built and run by tests/test_build.py.
#include "../../csrc/binding.cpp"
#include "../../csrc/paged_decode.cu"
#include "../../csrc/paged_prefill.cu"

#include <ATen/ATen.h>
#include <cstdio>
#include <functional>
#include <vector>

namespace nvfp4 {
cudaError_t launch_write_kv(const WriteKVParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_dequantize_kv(const DequantizeKVParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_prefill_hd64(const PrefillParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_prefill_hd128(const PrefillParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_prefill_hd256(const PrefillParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_decode_hd64(const DecodeParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_decode_hd128(const DecodeParams&, cudaStream_t) { std::abort(); }
cudaError_t launch_paged_decode_hd256(const DecodeParams&, cudaStream_t) { std::abort(); }
}  // namespace nvfp4
// the binding formats a failed launch's error; no launch happens here, and the CUDA runtime is not linked
extern "C" const char* cudaGetErrorString(cudaError_t) { std::abort(); }

static int checks = 0;

static bool expect_text(const std::string& got, const std::string& want) {
  ++checks;
  if (got == want) return true;
  std::printf("text: got \"%s\", want \"%s\"\n", got.c_str(), want.c_str());
  return false;
}

static bool expect_true(bool ok, const char* what) {
  ++checks;
  if (!ok) std::printf("false: %s\n", what);
  return ok;
}

static bool expect_error(const std::function<void()>& call, const std::string& want) {
  ++checks;
  try {
    call();
  } catch (const c10::Error& e) {
    if (e.what_without_backtrace() == want) return true;
    std::printf("error: got \"%s\", want \"%s\"\n", e.what_without_backtrace(), want.c_str());
    return false;
  }
  std::printf("error: no exception, want \"%s\"\n", want.c_str());
  return false;
}

int main() {
  const std::vector<int64_t> dims{1, 16, 2048};
  const at::Tensor cpu = at::zeros({2, 3, 64}, at::kHalf);
  const at::Tensor bytes = at::zeros({4, 16, 2, 32}, at::kByte);
  const at::Tensor ints = at::zeros({2}, at::kInt);
  const at::Tensor scalar = at::zeros({}, at::kFloat);
  bool ok = true;
  ok &= expect_text(text("num_splits must lie in [1, ", nvfp4::kMaxSplits, "], got ", int64_t(8193)),
                    "num_splits must lie in [1, 8192], got 8193");
  ok &= expect_text(text(at::IntArrayRef(dims), " ", cpu.sizes(), " ", size_t(7), " ", -3), "[1, 16, 2048] [2, 3, 64] 7 -3");
  ok &= expect_text(text(at::kBFloat16, " ", c10::Device("cpu"), " ", c10::string_view("6or4"), " ", std::string("s")),
                    "BFloat16 cpu 6or4 s");
  ok &= expect_error([] { CHECK_ARG(1 + 1 == 3, "n = ", 5, " of ", at::IntArrayRef({4, 5})); }, "n = 5 of [4, 5]");
  // the real entry points, on CPU tensors: their first check
  ok &= expect_error([&] {
    at::Tensor out = cpu.clone(), ws = bytes.view(-1);
    paged_attention(out, cpu, bytes, bytes, bytes, bytes, ints.view({1, 2}), ints, ints, scalar, scalar, 0.1, 0, 0.0,
                    std::nullopt, 1, 1, ws, "none", 1, false);
  }, "q must be a CUDA tensor, got cpu");
  ok &= expect_error([&] {
    at::Tensor b = bytes.clone();
    write_kv(cpu, cpu, ints.to(at::kLong), b, b, b, b, scalar, scalar, "6", "none");
  }, "key must be a CUDA tensor, got cpu");
  ok &= expect_error([&] {
    CHECK_ARG(nvfp4::decode_heads_per_block_ok(1, 8, 4), "heads_per_block ", int64_t(2),
              " needs max_query_len 1 and heads_per_block * group_size <= 8, got ", "max_query_len ", int64_t(2),
              " and group_size ", 4);
  }, "heads_per_block 2 needs max_query_len 1 and heads_per_block * group_size <= 8, got max_query_len 2 and group_size 4");
  // the fused kernel's limits: D 64 / 128, up to 16 rows, 8 kv heads per block up to 8 rows and 4 past them
  ok &= expect_true(nvfp4::decode_fused_ok(3, 8, 128) && nvfp4::decode_fused_ok(2, 16, 64) &&
                        !nvfp4::decode_fused_ok(3, 9, 128) && !nvfp4::decode_fused_ok(0, 17, 128) &&
                        !nvfp4::decode_fused_ok(0, 8, 256) && nvfp4::decode_fused_warps(8) == 16 &&
                        nvfp4::decode_fused_warps(9) == 12, "the fused kernel's limits");
  // cache tensors whose shapes disagree (a direct op call skips PagedKVCache.validate): the kernels would
  // index the smaller one with k_data's page count, page size and heads
  const at::Tensor scales = at::zeros({4, 16, 2, 4}, at::kByte);
  const c10::Device host("cpu");
  ok &= expect_error([&] { check_cache(bytes, scales, bytes.narrow(0, 0, 3), scales, host); },
                     "v_data must have k_data's shape [4, 16, 2, 32], got [3, 16, 2, 32]");
  ok &= expect_error([&] { check_cache(bytes, scales.narrow(1, 0, 8), bytes, scales.narrow(1, 0, 8), host); },
                     "k_block_scales must be [pages, page_size, heads, head_dim / 16] = [4, 16, 2, 4] for k_data "
                     "[4, 16, 2, 32], got [4, 8, 2, 4]");
  ok &= expect_error([&] { check_cache(bytes, scales, bytes, scales.narrow(0, 0, 2), host); },
                     "v_block_scales must have k_block_scales' shape [4, 16, 2, 4], got [2, 16, 2, 4]");
  ok &= expect_error([&] { query_type(scalar, "q"); }, "q must be float16 or bfloat16, got Float");
  ok &= expect_error([&] { log2_exact(24, "page_size"); }, "page_size must be a power of two, got 24");
  if (!ok) return 1;
  std::printf("ok: %d checks\n", checks);
  return 0;
}
