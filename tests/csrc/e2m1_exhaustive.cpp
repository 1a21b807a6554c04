// Every non-NaN float, both signs: the writer's e2m1_code == the threshold definition.  Then
// e2m1_pack8 (the writer's 8-codes-per-word packing) == e2m1_code of each value, on 8-vectors mixing
// the rounding thresholds and their neighbours, zeros, infinities and random floats.  Then the writer's
// block maximum over 6 (max_over_6) against the division.
// Built and run by tests/test_format.py::test_e2m1_fast_rounding_matches_the_definition_on_every_float.
#include <cstdio>
#include <initializer_list>
#include <vector>
#include "e2m1.h"

int main() {
  uint64_t checked = 0;
  for (uint64_t u = 0; u <= 0x7F800000u; ++u) {  // +0 .. +Inf
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float q = nvfp4::bit_cast<float>(static_cast<uint32_t>(u) | sign);
      const uint32_t fast = nvfp4::e2m1_code(q), want = nvfp4::e2m1_code_by_thresholds(q);
      if (fast != want) {
        std::printf("MISMATCH bits=0x%08x q=%.9g fast=%u want=%u\n", static_cast<uint32_t>(u) | sign, q, fast, want);
        return 1;
      }
      ++checked;
    }
  }
  std::printf("ok: %llu floats\n", static_cast<unsigned long long>(checked));

  std::vector<float> pool;
  for (float t : {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 6.0f, 7.0f,
                  1e-30f, 1e30f, 1.0f / 0.0f}) {
    const uint32_t bits = nvfp4::bit_cast<uint32_t>(t);
    for (uint32_t b : {bits, bits + 1, bits - 1})
      for (uint32_t sign : {0u, 0x80000000u}) {
        const float x = nvfp4::bit_cast<float>((b & 0x7FFFFFFFu) | sign);
        if (!std::isnan(x)) pool.push_back(x);  // 0 - 1 ulp and inf + 1 ulp wrap to NaN
      }
  }
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {  // xorshift64*
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 32);
  };
  uint64_t words = 0;
  for (int n = 0; n < 4000000; ++n) {
    float q[8];
    for (float& x : q) {
      const uint32_t r = next();
      if (r % 3 == 0) {
        x = pool[next() % pool.size()];
      } else if (r % 3 == 1) {
        x = (static_cast<float>(next() >> 8) / 16777216.0f - 0.5f) * 16.0f;  // [-8, 8)
      } else {
        uint32_t bits = next();
        if ((bits & 0x7F800000u) == 0x7F800000u) bits &= 0xFF7FFFFFu;  // no NaN (the writer never packs NaN)
        x = nvfp4::bit_cast<float>(bits);
      }
    }
    uint32_t want = 0;
    for (int k = 0; k < 8; ++k) want |= nvfp4::e2m1_code(q[k]) << (4 * k);
    const uint32_t got = nvfp4::e2m1_pack8(q);
    if (got != want) {
      std::printf("PACK MISMATCH got=0x%08x want=0x%08x q=", got, want);
      for (float x : q) std::printf("%a ", x);
      std::printf("\n");
      return 1;
    }
    ++words;
  }
  std::printf("ok: %llu packed words\n", static_cast<unsigned long long>(words));

  // the writer's amax / 6 (max_over_6) against the host's division, on every float in [0, 2^13]: equal
  // wherever the quotient is normal; below 2^-126 both are far under E4M3's smallest step (2^-9).
  // Above 2^13 both quotients exceed 464 and saturate to 448.
  uint64_t quotients = 0;
  for (uint32_t u = 0; u <= 0x46000000u; ++u) {  // +0 .. 2^13
    const float a = nvfp4::bit_cast<float>(u), got = nvfp4::max_over_6(a), want = a / 6.0f;
    const bool same = nvfp4::bit_cast<uint32_t>(got) == nvfp4::bit_cast<uint32_t>(want) ||
                      (want < 0x1p-126f && got < 0x1p-126f && got >= 0.0f);
    if (!same) {
      std::printf("QUOTIENT MISMATCH a=%a got=%a want=%a\n", a, got, want);
      return 1;
    }
    ++quotients;
  }
  for (float a : {8192.5f, 1e30f, 1.0f / 0.0f})
    if (!(nvfp4::max_over_6(a) > 464.0f && a / 6.0f > 464.0f)) {
      std::printf("QUOTIENT MISMATCH a=%a: not saturating\n", a);
      return 1;
    }
  std::printf("ok: %llu quotients\n", static_cast<unsigned long long>(quotients));
  return 0;
}
