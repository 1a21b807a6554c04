// E2M1 codes and E4M3 scale bytes <-> fp32.  Rounding an fp32 value onto an E2M1 code (format.py:
// round to nearest, ties to even, saturating at 6; bit 3 is the sign), and decoding codes and scale
// bytes.  Host and device code, so tests/csrc/e2m1_exhaustive.cpp can check the writer's fast
// rounding against the threshold definition on every float.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define NVFP4_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NVFP4_HOST_DEVICE inline
#endif

namespace nvfp4 {

// The bits of a value as another type of the same size (std::bit_cast is C++20; nvcc turns the
// copy into a register move).
template <typename To, typename From>
NVFP4_HOST_DEVICE To bit_cast(From x) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To y;
  memcpy(&y, &x, sizeof y);
  return y;
}

// The definition: the magnitude code counts the rounding thresholds |q| passes (a tie at 0.25,
// 1.25, 2.5 or 5 stays below, one at 0.75, 1.75 or 3.5 goes up: both land on the even code).
NVFP4_HOST_DEVICE uint32_t e2m1_code_by_thresholds(float q) {
  const float a = std::fabs(q);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return code | (std::signbit(q) ? 0x8u : 0u);
}

// [0, 1] clamp with NaN -> 0: on the device the .sat modifier of the instruction that computes x.
NVFP4_HOST_DEVICE float saturate(float x) {
#if defined(__CUDA_ARCH__)
  return __saturatef(x);
#else
  return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f;
#endif
}

// The same codes in fewer instructions, for every q that is not NaN (the writer stores NaN blocks
// without rounding them), all on the FP32 pipe: the grid has step 0.5 below 2, 1 in [2, 4) and 2
// in [4, 6], so the code is rint(2 min(a, 2)) + rint(clamp(a - 2, 0, 2)) + rint(clamp((a - 4) / 2,
// 0, 1)) for a = |q|.  Each clamped piece is exact (a scaled by a power of two, minus a value of its
// binade), and each is added onto 2^23 + an even partial sum whenever it is nonzero, so the
// hardware's round-to-nearest-even at the integer grid of 2^23 breaks ties as the format does.
// 2^23 + the magnitude code of q: its bits are 0x4B000000 | code.
NVFP4_HOST_DEVICE float e2m1_magnitude_on_2p23(float q) {
  const float a = std::fabs(q);
  float t = fmaf(saturate(a * 0.5f), 4.0f, 8388608.0f);  // 2^23 + rint(2 min(a, 2))
  t = fmaf(saturate(fmaf(a, 0.5f, -1.0f)), 2.0f, t);     // + rint(clamp(a - 2, 0, 2))
  t += saturate(fmaf(a, 0.5f, -2.0f));                    // + rint(clamp((a - 4) / 2, 0, 1))
  return t;
}
// One code.  The writer packs eight at a time (e2m1_pack8); the host test checks this one against
// the threshold definition and the packing against this one.
NVFP4_HOST_DEVICE uint32_t e2m1_code(float q) {
  return (bit_cast<uint32_t>(e2m1_magnitude_on_2p23(q)) & 0x7u) | ((bit_cast<uint32_t>(q) >> 28) & 0x8u);
}

// __byte_perm (default mode) on the host too, so the CPU test runs the device's packing logic.
NVFP4_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = (uint64_t(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
#endif
}

// The codes of 8 values in one word (value k in bits 4k..4k+3), as e2m1_code each, in about 17
// instructions instead of 32: the magnitudes add up as whole words, 0x4B000000 | code shifted by
// 4k, and the eight shifted 0x4B000000 sum to a constant (0xFB000000 mod 2^32) that is taken off
// once; the signs are the top bytes of the values, gathered by byte permutes onto bits 7, 15, 23,
// 31 (odd values) and, shifted by 4, onto 3, 11, 19, 27 (even values).
NVFP4_HOST_DEVICE uint32_t e2m1_pack8(const float* q) {
  uint32_t magnitudes = 0u - 0xFB000000u;
  for (int k = 0; k < 8; ++k) magnitudes += bit_cast<uint32_t>(e2m1_magnitude_on_2p23(q[k])) << (4 * k);
  const auto top_bytes = [&](int first) {  // byte 3 of q[first], q[first + 2], q[first + 4], q[first + 6]
    const uint32_t lo = byte_perm(bit_cast<uint32_t>(q[first]), bit_cast<uint32_t>(q[first + 2]), 0x0073u);
    const uint32_t hi = byte_perm(bit_cast<uint32_t>(q[first + 4]), bit_cast<uint32_t>(q[first + 6]), 0x0073u);
    return byte_perm(lo, hi, 0x5410u);
  };
  return (top_bytes(1) & 0x80808080u) | ((top_bytes(0) >> 4) & 0x08080808u) | magnitudes;
}

// A block maximum over 6, the scale rule's quotient (format.py: amax / 6, then rounded to E4M3), as
// the product with RN(1/6) and one FMA correction: 3 FP32 instructions where a division takes some 8
// and a slow-path branch.  For every a in [0, 2^13] it is the correctly rounded a / 6 wherever that
// is a normal float (the host test checks all of them); below 2^-126 both quotients become the E4M3
// zero alike.  Larger maxima are clamped to 2^13 first: every quotient from 464 up (Inf's too)
// saturates to E4M3's 448, and 2^13 / 6 is one of them.
NVFP4_HOST_DEVICE float max_over_6(float a) {
  constexpr float kInv6 = 0.16666667f;  // RN(1/6)
  a = a < 8192.0f ? a : 8192.0f;        // NaN never reaches it (NaN blocks are stored as such)
#if defined(__CUDA_ARCH__)
  const float q = __fmul_rn(a, kInv6);
  return __fmaf_rn(__fmaf_rn(-6.0f, q, a), kInv6, q);
#else
  const float q = a * kInv6;
  return std::fmaf(std::fmaf(-6.0f, q, a), kInv6, q);
#endif
}

// Code -> value: twice the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} as nibbles of one constant (a
// dynamically indexed array would live in local memory: it made the 6-or-4 writer 8x slower).
NVFP4_HOST_DEVICE float e2m1_value(uint32_t code) {
  const float m = 0.5f * float((0xC8643210u >> (4u * (code & 7u))) & 0xFu);
  return (code & 8u) ? -m : m;
}

// E4M3 byte -> fp32, exact, portable (no FP8 conversion instruction before SM89): eeee.mmm into
// the low exponent / top mantissa bits of an fp32 is value * 2^-120, subnormals included.
NVFP4_HOST_DEVICE float e4m3_value(uint32_t byte) {
  const uint32_t mag = byte & 0x7Fu;
  float v = bit_cast<float>(mag << 20) * 1.329227995784916e36f;  // * 2^120
  v = (mag == 0x7Fu) ? bit_cast<float>(0x7FC00000u) : v;
  return (byte & 0x80u) ? -v : v;
}

}  // namespace nvfp4
