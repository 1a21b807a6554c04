// Host-test stand-in for c10/cuda/CUDAStream.h (see CUDAGuard.h here).
#pragma once
#include <cuda_runtime.h>
#include <c10/core/Device.h>
namespace c10::cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace c10::cuda
