// Host-test stand-in for c10/cuda/CUDAGuard.h (a CPU build of torch ships no CUDA headers):
// just what csrc/binding.cpp uses, so tests/csrc/binding_messages.cpp compiles without CUDA torch.
#pragma once
#include <c10/core/Device.h>
namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace c10::cuda
