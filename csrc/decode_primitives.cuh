// Decode kernel primitives: PTX wrappers (copies, loads, MMA), the E2M1 unpack and the Hadamard
// transform of shared-memory rows.  Why each exists: docs/kernels.md#decode.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace nvfp4 {
namespace decode {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// dst: a shared address.  A negative zero_if_negative reads nothing and writes zeros (the ignore-src
// predicate, set inside the asm: a bool passed in became a register and a conversion back).
// .L2::128B: a miss fetches the whole 128-byte line into L2.  In token-major (NHD) pages a kv head's
// row is 64 bytes of a line whose other half is the next head's, read by another warp or block
// soon after: it then hits L2 instead of opening the DRAM row again (head-major pages, whose copies
// read whole lines anyway, gain nothing; docs/kernels.md#decode).
template <int kBytes>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, int zero_if_negative) {
  if constexpr (kBytes == 16) {
    asm volatile("{\n .reg .pred z;\n setp.lt.s32 z, %2, 0;\n cp.async.cg.shared.global.L2::128B [%0], [%1], 16, z;\n}\n"
                 ::"r"(dst), "l"(src), "r"(zero_if_negative));
  } else {
    asm volatile("{\n .reg .pred z;\n setp.lt.s32 z, %3, 0;\n cp.async.ca.shared.global.L2::128B [%0], [%1], %2, z;\n}\n"
                 ::"r"(dst), "l"(src), "n"(kBytes), "r"(zero_if_negative));
  }
}
// a * b + c, 32 x 32 bits + 64 bits: one IMAD.WIDE.U32
__device__ __forceinline__ const uint8_t* mad_wide(uint32_t a, uint32_t b, const uint8_t* c) {
  const uint8_t* d;
  asm("mad.wide.u32 %0, %1, %2, %3;\n" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}
// base + token * token_stride + page * page_stride as 32 x 32 + 64-bit multiply-adds: in C++, nvcc
// added one 64-bit offset to each base (some 15 instructions for a stage's three sources)
__device__ __forceinline__ const uint8_t* paged_source(const uint8_t* base, uint32_t page, uint32_t page_stride,
                                                       uint32_t token, uint32_t token_stride) {
  return mad_wide(page, page_stride, mad_wide(token, token_stride, base));
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// The value unchanged, but opaque to the compiler: it must keep it in a register instead of
// recomputing it from the parameters and the thread index wherever it is used (in the tile loop)
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}
template <typename T>
__device__ __forceinline__ const T* opaque(const T* x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}
// Read-only loads that stay where they are written: nvcc sinks plain loads towards their first use,
// and volatile asm keeps its order with the copies' (volatile) asm
__device__ __forceinline__ float load_in_order(const float* src) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(v) : "l"(src));
  return v;
}
__device__ __forceinline__ uint4 load_in_order(const uint4* src) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  return v;
}
__device__ __forceinline__ float4 load_in_order(const float4* src) {
  float4 v;
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(src));
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// (a & mask) | (b & ~mask) in one LOP3
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(mask));
  return r;
}

// Four fp16 pairs from the 8 E2M1 codes of a word (code k at bits 4k..4k+3, sign on top): (n0,n4),
// (n2,n6), (n1,n5), (n3,n7), each code as value * 2^-14.  An E2M1 code smmm is the fp16 high byte
// s000mmm0 (low byte 0), so the codes are first laid out one per byte in that form, even codes in
// one word and odd codes in another (6 instructions), and then each pair is one byte permute with
// zero bytes between.  The masks: bit 3 of each byte is in 0x0E, so `sign` keeps only bit 7 there.
__device__ __forceinline__ void unpack_word(uint32_t q, uint32_t (&pairs)[4]) {
  const uint32_t sign = q & 0x88888888u;
  // sign << 4 as its own shift: in plain C++ nvcc turns (q & m) << 4 into (q << 4) & (m << 4), which
  // does not reuse `sign`: an AND more per word
  uint32_t sign4;
  asm("shl.b32 %0, %1, 4;\n" : "=r"(sign4) : "r"(sign));
  const uint32_t even = select_bits(q << 1, sign4, 0x0E0E0E0Eu);  // codes 0, 2, 4, 6
  const uint32_t odd = select_bits(q >> 3, sign, 0x0E0E0E0Eu);        // codes 1, 3, 5, 7
  pairs[0] = __byte_perm(even, 0u, 0x2404);  // {0, byte 0, 0, byte 2}
  pairs[1] = __byte_perm(even, 0u, 0x3414);  // {0, byte 1, 0, byte 3}
  pairs[2] = __byte_perm(odd, 0u, 0x2404);
  pairs[3] = __byte_perm(odd, 0u, 0x3414);
}
// Element (within the word) of each pair's low half, in unpack_word order; the high half is +4.
__device__ __forceinline__ constexpr int pair_element(int j) { return j == 0 ? 0 : j == 1 ? 2 : j == 2 ? 1 : 3; }

// Token within a 16-token MMA tile held at MMA row m: rows (2c, 2c+1, 2c+8, 2c+9) are the
// 4 consecutive tokens 4c..4c+3, so the PV operand of thread c reads 4 adjacent rows.
__device__ __forceinline__ int tile_token(int m) { return 4 * ((m & 7) >> 1) + (m & 1) + ((m >> 3) << 1); }

// Unnormalized Walsh-Hadamard transform of `rows` rows of kHeadDim floats in shared memory, in
// place (KV mode "hadamard": x H = fwht(x) / sqrt(D)).  Every thread of the block calls it; it
// starts and ends with a barrier.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void fwht_rows(float* buf, int rows) {
  __syncthreads();
  for (int h = 1; h < kHeadDim; h *= 2) {
    for (int idx = threadIdx.x; idx < rows * (kHeadDim / 2); idx += kThreads) {
      const int j = idx % (kHeadDim / 2);
      float* x = buf + (idx / (kHeadDim / 2)) * kHeadDim + (j / h) * 2 * h + j % h;
      const float a = x[0], b = x[h];
      x[0] = a + b;
      x[h] = a - b;
    }
    __syncthreads();
  }
}

}  // namespace decode
}  // namespace nvfp4
