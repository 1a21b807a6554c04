// The prefill kernel's first steps: which request and query tile a block serves, the queries, one KV
// tile's copies and its dequantization into 16-bit shared memory.
#pragma once
#include "prefill_config.cuh"

namespace nvfp4 {
namespace prefill {

// ------------------------------------------------------------------ the block's work
struct Tile {
  int request, kv_head;
  int q_start, q_len, seq_len;  // the request's query rows in q and its cache positions
  int first_token, tokens;      // this block's query tokens (indices within the request)
  int kv_begin, kv_end;         // cache positions any of its rows may see
};

// Block x of the grid -> (request, query tile), without host lengths: request b's tiles start at
// query_start_loc[b] / tile_tokens + b, which leaves every request room for its ceil(q_len /
// tile_tokens) tiles.  Later tiles of a request (longer causal ranges) get the lower block indices.
// The request is found by a 32-way search, each warp on its own (no barrier): a step's 32 loads fly
// together and narrow the range 32-fold, so a batch of up to 1024 requests takes two dependent loads
// where a binary search takes ten (a step's decodes give the grid one block each, which only search).
__device__ __forceinline__ bool find_tile(const PrefillParams& p, Tile& t) {
  // kv heads vary fastest, so every head's longest tiles start in the first wave
  const int x = blockIdx.x / p.num_kv_heads;
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = p.batch - 1;  // the last request whose first tile is at or before x lies in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32): candidates lo + step .. lo + 32 step
    const int b = lo + (lane + 1) * step;
    const bool at_or_before = b <= hi && p.query_start_loc[b] / p.tile_tokens + b <= x;
    // first tiles rise with b, so the candidates at or before x are the first popc of them
    lo += __popc(__ballot_sync(0xffffffffu, at_or_before)) * step;
    hi = min(hi, lo + step - 1);
  }
  t.request = lo;
  t.kv_head = blockIdx.x % p.num_kv_heads;
  t.q_start = p.query_start_loc[lo];
  t.q_len = p.query_start_loc[lo + 1] - t.q_start;
  if (t.q_len < p.min_query_len || t.q_len <= 0) return false;  // shorter ones are the decode kernel's
  const int tiles = (t.q_len + p.tile_tokens - 1) / p.tile_tokens;
  const int local = x - (t.q_start / p.tile_tokens + lo);
  if (local < 0 || local >= tiles) return false;
  t.first_token = (tiles - 1 - local) * p.tile_tokens;
  t.tokens = min(p.tile_tokens, t.q_len - t.first_token);
  t.seq_len = p.seq_lens[lo];
  // bottom-right causal: token i sits at position seq_len - q_len + i
  const int first_pos = t.seq_len - t.q_len + t.first_token;
  t.kv_end = max(min(first_pos + t.tokens, t.seq_len), 0);
  t.kv_begin = p.sliding_window > 0 ? max(first_pos - p.sliding_window + 1, 0) : 0;
  return true;
}

// Elements from q's (or out's) start to the block's row r: token r / group, q head kv_head * group + r % group
__device__ __forceinline__ int64_t row_offset(const PrefillParams& p, const Tile& t, int r, int64_t stride_token,
                                              int64_t stride_head) {
  return (int64_t)(t.q_start + t.first_token + r / p.group_size) * stride_token +
         (int64_t)(t.kv_head * p.group_size + r % p.group_size) * stride_head;
}

// 2^e with amax * 2^e in [2^14, 2^15): fp16 holds a row of that maximum with room for the rounding
// (e <= 127: 2^e is finite; a row that small keeps its tiny elements as fp16 subnormals or zeros)
__device__ __forceinline__ int fp16_row_exponent(float amax) {
  return amax > 0.0f && amax < INFINITY ? min(14 - ilogbf(amax), 127) : 0;
}

// ------------------------------------------------------------------ step 1: the queries
// Each warp loads its own kWarpRows rows (row r: token r / group, q head kv_head * group + r % group),
// rotated by H in the Hadamard mode, scaled by a power of two into fp16 (its inverse stored in
// row_scale[r]), stored in the permuted head-dim order, 16 rows at a time.
template <typename T, typename C>
__device__ __forceinline__ void load_row_tile(const PrefillParams& p, const Tile& t, __half* q_rows, int rt,
                                              float* row_scale) {
  constexpr int E = C::kElementsPerLane;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t w[16][E / 2];  // every row's loads in flight before the first is used
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = warp * C::kWarpRows + rt * 16 + i, token = r / p.group_size;
#pragma unroll
    for (int j = 0; j < E / 2; ++j) w[i][j] = 0u;
    if (token < t.tokens) {
      const T* src = static_cast<const T*>(p.q) + row_offset(p, t, r, p.q_stride_token, p.q_stride_head) + lane * E;
      if constexpr (E == 8) *reinterpret_cast<uint4*>(w[i]) = *reinterpret_cast<const uint4*>(src);
      if constexpr (E == 4) *reinterpret_cast<uint2*>(w[i]) = *reinterpret_cast<const uint2*>(src);
      if constexpr (E == 2) w[i][0] = *reinterpret_cast<const uint32_t*>(src);
    }
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int r = warp * C::kWarpRows + rt * 16 + i;
    float x[E];
#pragma unroll
    for (int j = 0; j < E / 2; ++j) {  // rows past the tile's tokens are zeros
      const float2 f = to_float2(w[i][j], T());
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
    if (p.hadamard) hadamard_row<E>(x, p.hadamard_scale);
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < E; ++j) amax = fmaxf(amax, fabsf(x[j]));
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const int e = fp16_row_exponent(amax);
    const float up = ldexpf(1.0f, e);
    if (lane == 0) row_scale[r] = ldexpf(1.0f, -e);
    __half* row = q_rows + r * C::kPitch + (lane * E & ~7);
#pragma unroll
    for (int j = 0; j < E; ++j) row[stored_at((lane * E + j) & 7)] = __float2half_rn(x[j] * up);
  }
}

// The same rows, one per lane (warps of 32 rows, D <= 128, no rotation): a lane loads its whole row,
// takes its maximum alone and stores it in 16-byte pieces, where the row-per-warp order above spends
// five shuffles and a dozen scalar steps per row (at D 64, some 1700 instructions per warp against
// about 300: a short window's block has a few KV tiles to share that cost).  The same arithmetic
// element by element, so the same bits.
template <typename T, typename C>
__device__ __forceinline__ void load_rows_by_lane(const PrefillParams& p, const Tile& t, __half* q_rows, float* row_scale) {
  constexpr int kPieces = C::kHeadDim / 8;  // 16-byte pieces of 8 elements
  const int r = threadIdx.x, token = r / p.group_size;  // warp w's lanes hold rows 32 w ..
  uint4 w[kPieces];
  const T* src = static_cast<const T*>(p.q) + row_offset(p, t, r, p.q_stride_token, p.q_stride_head);
#pragma unroll
  for (int k = 0; k < kPieces; ++k) w[k] = token < t.tokens ? reinterpret_cast<const uint4*>(src)[k] : make_uint4(0, 0, 0, 0);
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const uint32_t words[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = to_float2(words[j], T());
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  const int e = fp16_row_exponent(amax);
  const float up = ldexpf(1.0f, e);
  row_scale[r] = ldexpf(1.0f, -e);
  uint4* row = reinterpret_cast<uint4*>(q_rows + r * C::kPitch);
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    const uint32_t words[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
    float x[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = to_float2(words[j], T());
      x[2 * j] = f.x * up;
      x[2 * j + 1] = f.y * up;
    }
    // stored position s holds element stored_at(s) (an involution): pairs (0 4) (2 6) (1 5) (3 7)
    row[k] = make_uint4(pack2(x[stored_at(0)], x[stored_at(1)], __half()), pack2(x[stored_at(2)], x[stored_at(3)], __half()),
                        pack2(x[stored_at(4)], x[stored_at(5)], __half()), pack2(x[stored_at(6)], x[stored_at(7)], __half()));
  }
}

template <typename T, typename C>
__device__ __forceinline__ void load_queries(const PrefillParams& p, const Tile& t, __half* q_rows, float* row_scale) {
  if constexpr (C::kWarpRows == 32) {
    if (!p.hadamard) return load_rows_by_lane<T, C>(p, t, q_rows, row_scale);
  }
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt) load_row_tile<T, C>(p, t, q_rows, rt, row_scale);
}

// ------------------------------------------------------------------ step 2: one tile's copies
// Tile `tile` (positions tile * kTileTokens ...) of the request's K and V codes and block scales into
// a stage; positions past kv_end are zero-filled.  kCopyThreads threads per position.
template <typename C>
__device__ __forceinline__ void issue_copies(const PrefillParams& p, const Tile& t, int tile, uint8_t* stage) {
  const int n = threadIdx.x / C::kCopyThreads, sub = threadIdx.x % C::kCopyThreads;
  const int pos = tile * C::kTileTokens + n;
  const bool live = pos < t.kv_end;
  int64_t page = 0;
  int in_page = 0;
  if (live) {
    page = p.block_table[(int64_t)t.request * p.block_table_stride + pos / p.page_size];
    in_page = pos % p.page_size;
  }
  const int zero_if_negative = live ? 0 : -1;
  const int64_t data_row = page * p.data_strides.page + in_page * p.data_strides.token + t.kv_head * p.data_strides.head;
  const uint32_t codes = smem_addr(stage) + n * C::kDataBytes;
#pragma unroll
  for (int i = 0; i < C::kChunks; ++i) {
    const int chunk = sub + i * C::kCopyThreads;  // chunks of K's row, then of V's
    const int side = chunk * C::kCopyBytes / C::kDataBytes, offset = chunk * C::kCopyBytes % C::kDataBytes;
    const uint8_t* src = (side ? p.v_data : p.k_data) + (live ? data_row + offset : 0);
    cp_async<C::kCopyBytes>(codes + side * C::kTileTokens * C::kDataBytes + offset, src, zero_if_negative);
  }
  if (sub < 2) {  // thread 0 of the position copies K's scales, thread 1 V's
    const int64_t scale_row = page * p.scale_strides.page + in_page * p.scale_strides.token + t.kv_head * p.scale_strides.head;
    const uint8_t* src = (sub ? p.v_block_scales : p.k_block_scales) + (live ? scale_row : 0);
    cp_async<C::kScaleBytes>(smem_addr(stage) + 2 * C::kTileTokens * C::kDataBytes +
                                 (sub * C::kTileTokens + n) * C::kScaleBytes, src, zero_if_negative);
  }
}

// ------------------------------------------------------------------ step 3: dequantize once
// A stage's codes x block scales -> the 16-bit K and V tiles, 16 elements (8 code bytes, one scale)
// per item, in the permuted head-dim order.
template <typename C>
__device__ __forceinline__ void dequantize_tile(const uint8_t* stage, const uint32_t* scale_lut, __half* k_tile, __half* v_tile) {
  // thread t: block t % kBlocks of positions t / kBlocks + kPass * i, so every offset below but the
  // thread's own is a compile-time constant
  constexpr int kBlocks = C::kHeadDim / 16, kPass = C::kThreads / kBlocks;
  static_assert(C::kThreads % kBlocks == 0 && C::kTileTokens % kPass == 0, "whole passes");
  const int blk = threadIdx.x % kBlocks, n0 = threadIdx.x / kBlocks;
  const uint8_t* codes = stage + n0 * C::kDataBytes + blk * 8;
  const uint8_t* scales = stage + 2 * C::kTileTokens * C::kDataBytes + n0 * C::kScaleBytes + blk;
#pragma unroll
  for (int side = 0; side < 2; ++side) {
    __half* tile = (side ? v_tile : k_tile) + n0 * C::kPitch + blk * 16;
#pragma unroll 1  // more items in flight only add registers: the output accumulators are live here
    for (int i = 0; i < C::kTileTokens / kPass; ++i) {
      const int n = side * C::kTileTokens + i * kPass;  // position offset from the thread's first
      const uint2 code = *reinterpret_cast<const uint2*>(codes + n * C::kDataBytes);
      const uint32_t scale = scale_lut[scales[n * C::kScaleBytes]];
      uint32_t lo[4], hi[4];
      unpack_word(code.x, lo);
      unpack_word(code.y, hi);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo[j] = mul2(lo[j], scale);
        hi[j] = mul2(hi[j], scale);
      }
      uint4* dst = reinterpret_cast<uint4*>(tile + i * kPass * C::kPitch);
      dst[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
      dst[1] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
  }
}

}  // namespace prefill
}  // namespace nvfp4
