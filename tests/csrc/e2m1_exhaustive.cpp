// Every non-NaN float, both signs: the writer's e2m1_code == the threshold definition.
// Built and run by tests/test_format.py::test_e2m1_fast_rounding_matches_the_definition_on_every_float.
#include <cstdio>
#include <initializer_list>
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
  return 0;
}
