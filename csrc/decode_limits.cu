// The generated limits (nvfp4_limits.h, from nvfp4_backend/capabilities.py) that follow from the decode
// kernels' own layout, checked against it at compile time: the planner, the ops and the binding decide
// with the generated numbers, so a kernel change that moves one fails the build here until
// capabilities.py says the same.  No code: compile-time checks only.
#include "decode_kernel.cuh"

namespace nvfp4::decode {
namespace {

template <int N, int M>
constexpr bool same(const int (&a)[N], const int (&b)[M]) {
  if (N != M) return false;
  for (int i = 0; i < N; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// the head dims paged_decode.cu, paged_prefill.cu and write_kv.cu instantiate
static_assert(same(kHeadDims, {64, 128, 256}), "capabilities.SUPPORTED_HEAD_DIMS are not the kernels' head dims");
static_assert(same(kFusedHeadDims, {64, 128}), "capabilities.FUSED_HEAD_DIMS are not the fused kernel's head dims");

// rows: a row tile of the MMA, and the widest configuration launch_for_rows takes per head dim
static_assert(Config<128, 1, 1>::kMaxRows == kRowTile, "capabilities.ROW_TILE is not the kernels' row tile");
template <int kHeadDim>
constexpr bool widest_serves_max_rows() {
  return RowConfigOf<kHeadDim, decode_max_rows(kHeadDim)>::kMaxRows == decode_max_rows(kHeadDim);
}
static_assert(widest_serves_max_rows<64>() && widest_serves_max_rows<128>() && widest_serves_max_rows<256>(),
              "capabilities.DECODE_MAX_ROWS are not the decode kernels' widest row configurations");

// blocks per SM: the split planner never aims for more than a static kernel's launch bound keeps
// resident (0: a bound left to the compiler).  kDecodeBlocksPerSm: [head dim][row band]
static_assert(same(kDecodeRowBands, {8, 16, 32, 64}), "capabilities.DECODE_ROW_BANDS are not launch_for_rows' row bands");
constexpr int kBands = int(sizeof(kDecodeRowBands) / sizeof(kDecodeRowBands[0]));
constexpr int planned_blocks_per_sm(int head_dim, int rows) {
  int band = 0;
  while (band + 1 < kBands && rows > kDecodeRowBands[band]) ++band;
  for (int i = 0; i < int(sizeof(kHeadDims) / sizeof(kHeadDims[0])); ++i)
    if (kHeadDims[i] == head_dim) return kDecodeBlocksPerSm[i * kBands + band];
  return 0;
}
template <int kHeadDim, int kRows>
constexpr bool bound_keeps_planned() {
  constexpr int bound = RowConfigOf<kHeadDim, kRows>::kMinBlocksPerSm;
  return kRows > decode_max_rows(kHeadDim) || bound == 0 || bound >= planned_blocks_per_sm(kHeadDim, kRows);
}
template <int kHeadDim>
constexpr bool bounds_keep_planned() {
  return bound_keeps_planned<kHeadDim, 8>() && bound_keeps_planned<kHeadDim, 16>() && bound_keeps_planned<kHeadDim, 32>() &&
         bound_keeps_planned<kHeadDim, 64>();
}
static_assert(bounds_keep_planned<64>() && bounds_keep_planned<128>() && bounds_keep_planned<256>(),
              "capabilities.DECODE_BLOCKS_PER_SM plans more blocks per SM than a decode kernel's launch bound keeps resident");

// kv heads per block: the static kernels of one row tile, the fused kernels of one and two
static_assert(Config<64, 1, 1>::kMaxHeads == kPackedMaxHeads && Config<128, 1, 1>::kMaxHeads == kPackedMaxHeads,
              "capabilities.PACKED_MAX_HEADS is not the static kernels' kv heads per block");
template <int kHeadDim, int kRowTiles>
using Fused = Config<kHeadDim, kRowTiles, 1, decode_fused_warps(kRowTiles * kRowTile)>;
template <int kHeadDim>
constexpr bool fused_heads_fit() {
  return Fused<kHeadDim, 1>::kMaxHeads == kFusedHeadTiles && Fused<kHeadDim, 2>::kMaxHeads * 2 == kFusedHeadTiles &&
         Fused<kHeadDim, 2>::kMaxRows == kFusedMaxRows;
}
static_assert(fused_heads_fit<64>() && fused_heads_fit<128>(),
              "capabilities.FUSED_HEAD_TILES / FUSED_MAX_ROWS are not the fused kernel's heads and rows per block");

// shared memory: the planner picks the fused kernel where a device gives a block FUSED_SHARED_MEMORY
constexpr int kLargestFusedBlock = cmax(cmax(Fused<64, 1>::kSmemBytes, Fused<64, 2>::kSmemBytes),
                                        cmax(Fused<128, 1>::kSmemBytes, Fused<128, 2>::kSmemBytes));
static_assert(kLargestFusedBlock == kFusedSharedMemory,
              "capabilities.FUSED_SHARED_MEMORY is not the fused kernel's largest block (Config::kSmemBytes)");

}  // namespace
}  // namespace nvfp4::decode
