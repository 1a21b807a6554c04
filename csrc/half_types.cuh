// fp16 / bf16 conversions the kernels share, as overloads on the element type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace nvfp4 {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// A packed pair (`lo` in the low 16 bits) -> two floats, exact.
__device__ __forceinline__ float2 to_float2(uint32_t pair, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&pair));
}
__device__ __forceinline__ float2 to_float2(uint32_t pair, __nv_bfloat16) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xFFFF0000u));
}

// Two floats rounded to nearest even into one packed pair, `lo` in the low 16 bits.
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace nvfp4
