// Prints the largest shared-memory size of the fused decode kernel's blocks (csrc Config), which
// ops.FUSED_SHARED_MEMORY mirrors.  Host code only: built with nvcc and run by tests/test_build.py.
#include <cstdio>
#include "../../csrc/decode_kernel.cuh"

int main() {
  using nvfp4::decode::Config;
  const int sizes[] = {Config<64, 1, 1, 16>::kSmemBytes, Config<64, 2, 1, 12>::kSmemBytes,
                       Config<128, 1, 1, 16>::kSmemBytes, Config<128, 2, 1, 12>::kSmemBytes};
  int largest = 0;
  for (int s : sizes) largest = s > largest ? s : largest;
  std::printf("%d\n", largest);
  return 0;
}
