// Paged prefill (extend) over the NVFP4 cache: one launch for a whole ragged batch.
//
// Design (docs/kernels.md#prefill): FlashAttention-2's loop on mma.sync m16n8k16, with each KV tile
// copied as NVFP4 (0.5625 bytes per element) and dequantized ONCE into 16-bit shared memory, where the
// stock ldmatrix + MMA path reads it, instead of once per MMA fragment.  A block holds 64 packed query
// rows (q_len tokens x the kv head's group of q heads, GQA packing), so every dequantized tile serves
// all of them.  The grid is an upper bound known from shapes alone (q tokens / tile tokens + batch
// blocks per kv head, as vLLM's unified attention does): a block finds its request by a binary search
// over query_start_loc on the device, so nothing is read on the host and a CUDA graph replays it with
// new lengths.
//
// Numerics follow the decode kernel (decode_kernel.cuh): the MMAs run in fp16 for both query dtypes.
// A dequantized element is e2m1 x e4m3 x 2^-7 (exact in fp16); each query row is scaled by a power of
// two into fp16's range (exact for bf16 queries but for elements far below the row's maximum); the
// K global scale, the 2^7 and the row's power of two fold into the logits' scale, the V global scale
// and the 2^7 into the output.  Within each 8-element group the head dim is stored in unpack_word's
// order (0 4 2 6 1 5 3 7) in Q, K and V alike: Q.K does not depend on the order, and the epilogue puts
// the output columns back.
#pragma once
#include "decode_config.cuh"      // the numerics shared with decode: kScaleBias, kWeightBiasLog2, scale2
#include "decode_primitives.cuh"  // the PTX wrappers and unpack_word
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace prefill {

using decode::cp_async;
using decode::cp_async_commit;
using decode::cp_async_wait;
using decode::fast_exp2;
using decode::mma;
using decode::mul2;
using decode::scale2;
using decode::smem_addr;
using decode::unpack_word;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kValueBias = 128.0f;  // dequantized K/V carry 2^-7 (decode::kScaleBias)
using decode::kWeightBiasLog2;        // softmax weights x 2^15: fp16 keeps them normal down to 2^-29 of the max

template <int kHeadDim_, int kCopyBytes_>
struct Config {
  static constexpr int kHeadDim = kHeadDim_, kCopyBytes = kCopyBytes_;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  // m16 row tiles per warp: two where the registers allow (each K and V fragment read from shared
  // memory then feeds two MMAs: shared-memory bandwidth, not the tensor cores, bounds one), one at D 256
  static constexpr int kRowTiles = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kWarpRows = 16 * kRowTiles;
  static constexpr int kRows = kWarpRows * kWarps;  // packed query rows per block
  static_assert(kRows == prefill_rows(kHeadDim), "the host sizes tiles by prefill_rows()");
  static constexpr int kTileTokens = kHeadDim <= 128 ? 64 : 32;  // KV positions per tile (docs/kernels.md#prefill)
  static constexpr int kPitch = kHeadDim + 8;  // 16-bit elements per row: the 16-byte pad keeps ldmatrix conflict-free
  static constexpr int kDataBytes = kHeadDim / 2, kScaleBytes = kHeadDim / 16;
  static constexpr int kStages = 2;  // NVFP4 tiles in flight
  // shared memory: Q rows, the dequantized K and V tiles, the copy stages, the E4M3 -> fp16x2 table
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kRows * kPitch * 2;
  static constexpr int kVOffset = kKOffset + kTileTokens * kPitch * 2;
  // a stage: K codes, V codes (tokens x kDataBytes each), K scales, V scales (tokens x kScaleBytes)
  static constexpr int kStageOffset = kVOffset + kTileTokens * kPitch * 2;
  static constexpr int kStageBytes = 2 * kTileTokens * (kDataBytes + kScaleBytes);
  static constexpr int kLutOffset = kStageOffset + kStages * kStageBytes;
  // per row: the logit scale (raw score -> logit in log2 units: the row's power of two inside) and the
  // cache position (-1: no such row), read per tile instead of held in registers
  static constexpr int kRowInfoOffset = kLutOffset + 256 * 4;
  static constexpr int kSmemBytes = kRowInfoOffset + kRows * 8;
  // the epilogue's fp32 output rows reuse Q, K and V's space once the loop is done
  static constexpr int kOutPitch = kHeadDim + 4;
  static_assert(kWarps * 16 * kOutPitch * 4 <= kStageOffset, "the epilogue's rows must fit the tiles' space");
  // the copies: kCopyThreads threads per token share its K and V codes; two of them its scales
  static constexpr int kCopyThreads = kThreads / kTileTokens;
  static constexpr int kChunks = 2 * kDataBytes / kCopyBytes / kCopyThreads;  // data copies per thread
  static_assert(kCopyThreads >= 2 && kChunks * kCopyThreads * kCopyBytes == 2 * kDataBytes, "copy split");
  static constexpr int kElementsPerLane = kHeadDim / 32;  // a row across a warp (Q load, epilogue)
  // resident blocks the registers must allow (two: each block's barriers leave the tensor cores idle)
  static constexpr int kMinBlocks = 2;
};

// ------------------------------------------------------------------ small helpers
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Where element e of an 8-element group is stored (unpack_word's pair order; an involution).
__device__ __forceinline__ constexpr int stored_at(int e) { return (e & 1) * 4 + (e >> 1 & 1) * 2 + (e >> 2 & 1); }
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// tanh(x) = 1 - 2 / (e^2x + 1): ex2 and a reciprocal, accurate to ~1e-7 absolute (tanh.approx's 2^-11
// relative error moves capped logits by up to cap x 5e-4, visibly in the softmax)
__device__ __forceinline__ float tanh_accurate(float x) {
  return 1.0f - 2.0f * fast_rcp(fast_exp2(2.0f * kLog2e * x) + 1.0f);
}
// x H for a row spread over a warp, lane holding elements [lane * E, lane * E + E): Sylvester-order
// fast Walsh-Hadamard butterflies in fp32 (format.hadamard_transform), then one multiply.
template <int E>
__device__ __forceinline__ void hadamard_row(float (&x)[E], float scale) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 1; h < E; h <<= 1)
#pragma unroll
    for (int j = 0; j < E; ++j)
      if (!(j & h)) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const float other = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = (lane & m) ? other - x[j] : x[j] + other;
    }
#pragma unroll
  for (int j = 0; j < E; ++j) x[j] *= scale;
}

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
__device__ __forceinline__ bool find_tile(const PrefillParams& p, Tile& t) {
  // kv heads vary fastest, so every head's longest tiles start in the first wave
  const int x = blockIdx.x / p.num_kv_heads;
  int lo = 0, hi = p.batch - 1;  // the last request whose first tile is at or before x
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.query_start_loc[mid] / p.tile_tokens + mid <= x) lo = mid; else hi = mid - 1;
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
      const T* src = static_cast<const T*>(p.q) + (int64_t)(t.q_start + t.first_token + token) * p.q_stride_token +
                     (int64_t)(t.kv_head * p.group_size + r % p.group_size) * p.q_stride_head + lane * E;
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
    // 2^e with amax * 2^e in [2^14, 2^15): fp16 holds it with room for the rounding (e <= 127: 2^e is
    // finite; a row that small keeps its tiny elements as fp16 subnormals or zeros)
    const int e = amax > 0.0f && amax < INFINITY ? min(14 - ilogbf(amax), 127) : 0;
    const float up = ldexpf(1.0f, e);
    if (lane == 0) row_scale[r] = ldexpf(1.0f, -e);
    __half* row = q_rows + r * C::kPitch + (lane * E & ~7);
#pragma unroll
    for (int j = 0; j < E; ++j) row[stored_at((lane * E + j) & 7)] = __float2half_rn(x[j] * up);
  }
}

template <typename T, typename C>
__device__ __forceinline__ void load_queries(const PrefillParams& p, const Tile& t, __half* q_rows, float* row_scale) {
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

// ------------------------------------------------------------------ step 4: scores and softmax
// The warp's state for the thread's rows, thread_row(i) for i < 2 kRowTiles (row tile i / 2, MMA row
// lane / 4 + 8 (i % 2)): running maxima (log2 units) and sums, and the output accumulator (m16 x
// kHeadDim per row tile, the MMA's C layout).
template <typename C>
struct RowState {
  static constexpr int kThreadRows = 2 * C::kRowTiles;
  float o[C::kRowTiles][C::kHeadDim / 8][4];
  float max[kThreadRows], sum[kThreadRows];
  const float* logit_scale;  // [kRows] in shared memory (Config::kRowInfoOffset), log2 units
  const int* pos;            // [kRows]
};
template <typename C>
__device__ __forceinline__ int thread_row(int i) {
  return (threadIdx.x >> 5) * C::kWarpRows + (i >> 1) * 16 + ((threadIdx.x & 31) >> 2) + 8 * (i & 1);
}
template <typename C>
using Scores = float[C::kRowTiles][C::kTileTokens / 8][4];

// S = Q K^T for the warp's rows and the tile's positions (raw fp32 scores); each K fragment serves
// every row tile
template <typename C>
__device__ __forceinline__ void tile_scores(uint32_t q_rows, uint32_t k_tile, Scores<C>& s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt)
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[rt][nt][i] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < C::kHeadDim / 16; ++ks) {
    uint32_t a[C::kRowTiles][4];
#pragma unroll
    for (int rt = 0; rt < C::kRowTiles; ++rt)
      ldmatrix_x4(a[rt], q_rows + ((warp * C::kWarpRows + rt * 16 + (lane & 15)) * C::kPitch + ks * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; nt += 2) {
      uint32_t b[4];  // positions nt * 8.. and (nt + 1) * 8.., head dims ks * 16 + {0, 8}
      ldmatrix_x4(b, k_tile + (((nt + (m >> 1)) * 8 + (lane & 7)) * C::kPitch + ks * 16 + (m & 1) * 8) * 2);
#pragma unroll
      for (int rt = 0; rt < C::kRowTiles; ++rt) {
        mma(s[rt][nt], a[rt], b[0], b[1]);
        mma(s[rt][nt + 1], a[rt], b[2], b[3]);
      }
    }
  }
}

// Masks, soft-caps and exponentiates the tile's scores in place (the fp16 weights' inputs, x 2^15),
// updating the running maxima and sums and rescaling the output.
template <bool kMasked, bool kCapped, typename C>
__device__ __forceinline__ void online_softmax(const PrefillParams& p, RowState<C>& st, Scores<C>& s, int tile_start) {
  const int lane = threadIdx.x & 31;
  // the logit scale carries log2(e): x is the logit in log2 units, capped as cap * tanh(logit / cap)
  const float cap_log2 = p.logits_soft_cap * kLog2e, inv_cap_log2 = 1.0f / cap_log2;
#pragma unroll
  for (int h = 0; h < RowState<C>::kThreadRows; ++h) {
    const int rt = h >> 1, half = h & 1;
    const float logit_scale = st.logit_scale[thread_row<C>(h)];
    const int pos = st.pos[thread_row<C>(h)];
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float x = s[rt][nt][2 * half + j] * logit_scale;
        if constexpr (kCapped) x = cap_log2 * tanh_accurate(x * inv_cap_log2);
        if constexpr (kMasked) {
          const int kv = tile_start + nt * 8 + 2 * (lane & 3) + j;
          const bool visible = kv <= pos && (p.sliding_window <= 0 || kv > pos - p.sliding_window);
          x = visible ? x : -INFINITY;
        }
        s[rt][nt][2 * half + j] = x;
        tile_max = fmaxf(tile_max, x);
      }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(st.max[h], tile_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row that sees nothing yet stays 0
    const float rescale = fast_exp2(st.max[h] - base);
    st.max[h] = new_max;
    st.sum[h] *= rescale;
#pragma unroll
    for (int dt = 0; dt < C::kHeadDim / 8; ++dt) {
      st.o[rt][dt][2 * half] *= rescale;
      st.o[rt][dt][2 * half + 1] *= rescale;
    }
#pragma unroll
    for (int nt = 0; nt < C::kTileTokens / 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float w = fast_exp2(s[rt][nt][2 * half + j] - base + kWeightBiasLog2);
        s[rt][nt][2 * half + j] = w;
        st.sum[h] += w;
      }
  }
}

// O += P V: the weights' C fragments of two position octets are the A fragment of one k step; each V
// fragment serves every row tile
template <typename C>
__device__ __forceinline__ void tile_values(RowState<C>& st, const Scores<C>& s, uint32_t v_tile) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int ks = 0; ks < C::kTileTokens / 16; ++ks) {
    uint32_t a[C::kRowTiles][4];
#pragma unroll
    for (int rt = 0; rt < C::kRowTiles; ++rt) {
      a[rt][0] = pack2(s[rt][2 * ks][0], s[rt][2 * ks][1], __half());
      a[rt][1] = pack2(s[rt][2 * ks][2], s[rt][2 * ks][3], __half());
      a[rt][2] = pack2(s[rt][2 * ks + 1][0], s[rt][2 * ks + 1][1], __half());
      a[rt][3] = pack2(s[rt][2 * ks + 1][2], s[rt][2 * ks + 1][3], __half());
    }
#pragma unroll
    for (int dt = 0; dt < C::kHeadDim / 8; dt += 2) {
      uint32_t b[4];  // positions ks * 16 + {0, 8}.., head dims dt * 8.. and (dt + 1) * 8..
      ldmatrix_x4_trans(b, v_tile + ((ks * 16 + (m & 1) * 8 + (lane & 7)) * C::kPitch + (dt + (m >> 1)) * 8) * 2);
#pragma unroll
      for (int rt = 0; rt < C::kRowTiles; ++rt) {
        mma(st.o[rt][dt], a[rt], b[0], b[1]);
        mma(st.o[rt][dt + 1], a[rt], b[2], b[3]);
      }
    }
  }
}

// ------------------------------------------------------------------ step 5: the epilogue
// Sinks join the denominator, the rows are normalized and staged in fp32 (head-dim order restored),
// then each row is rotated back by H (Hadamard mode) and stored by its warp, 16-byte pieces per lane.
template <typename T, typename C>
__device__ __forceinline__ void store_output(const PrefillParams& p, const Tile& t, RowState<C>& st, float* rows) {
  constexpr int E = C::kElementsPerLane;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float v_scale = *p.v_global_scale * kValueBias;
  float* warp_rows = rows + warp * 16 * C::kOutPitch;  // one row tile at a time
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = 2 * rt + half, r = thread_row<C>(h);
      float sum = st.sum[h];  // the thread's columns: the row's four threads add theirs up
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      float out_scale = v_scale;
      if (p.sinks != nullptr && st.pos[r] >= 0) {  // one more logit in the denominator, weighed as the rest
        const float sink = p.sinks[t.kv_head * p.group_size + r % p.group_size] * kLog2e;
        const float new_max = fmaxf(st.max[h], sink);
        const float rescale = fast_exp2(st.max[h] - new_max);
        sum = sum * rescale + fast_exp2(sink - new_max + kWeightBiasLog2);
        out_scale *= rescale;
      }
      out_scale = sum > 0.0f ? out_scale / sum : 0.0f;
      float* row = warp_rows + ((lane >> 2) + 8 * half) * C::kOutPitch;
#pragma unroll
      for (int dt = 0; dt < C::kHeadDim / 8; ++dt)
#pragma unroll
        for (int j = 0; j < 2; ++j) row[dt * 8 + stored_at(2 * (lane & 3) + j)] = st.o[rt][dt][2 * half + j] * out_scale;
    }
    __syncwarp();
    for (int i = 0; i < 16; ++i) {
      const int r = warp * C::kWarpRows + rt * 16 + i, token = r / p.group_size;
      if (token >= t.tokens) break;  // rows past the tile's tokens: rows are token-major, none follow
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = warp_rows[i * C::kOutPitch + lane * E + j];
      if (p.hadamard) hadamard_row<E>(x, p.hadamard_scale);
      uint32_t w[E / 2];
#pragma unroll
      for (int j = 0; j < E / 2; ++j) w[j] = pack2(x[2 * j], x[2 * j + 1], T());
      T* dst = static_cast<T*>(p.out) + (int64_t)(t.q_start + t.first_token + token) * p.out_stride_token +
               (int64_t)(t.kv_head * p.group_size + r % p.group_size) * p.out_stride_head + lane * E;
      if constexpr (E == 8) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(w);
      if constexpr (E == 4) *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(w);
      if constexpr (E == 2) *reinterpret_cast<uint32_t*>(dst) = w[0];
    }
    __syncwarp();  // the next row tile overwrites the rows
  }
}

// ------------------------------------------------------------------ the kernel
template <typename T, int kHeadDim, int kCopyBytes>
__global__ void __launch_bounds__(Config<kHeadDim, kCopyBytes>::kThreads, Config<kHeadDim, kCopyBytes>::kMinBlocks)
paged_prefill_kernel(const __grid_constant__ PrefillParams p) {
  using C = Config<kHeadDim, kCopyBytes>;
  extern __shared__ __align__(16) uint8_t smem[];
  Tile t;
  if (!find_tile(p, t)) return;
  __half* q_rows = reinterpret_cast<__half*>(smem + C::kQOffset);
  __half* k_tile = reinterpret_cast<__half*>(smem + C::kKOffset);
  __half* v_tile = reinterpret_cast<__half*>(smem + C::kVOffset);
  uint32_t* scale_lut = reinterpret_cast<uint32_t*>(smem + C::kLutOffset);
  auto stage = [&](int tile) { return smem + C::kStageOffset + (tile % C::kStages) * C::kStageBytes; };

  const int first_tile = t.kv_begin / C::kTileTokens;
  const int end_tile = (t.kv_end + C::kTileTokens - 1) / C::kTileTokens;
#pragma unroll
  for (int i = 0; i < C::kStages; ++i) {  // the first tiles' copies fly while the queries load
    if (first_tile + i < end_tile) issue_copies<C>(p, t, first_tile + i, stage(first_tile + i));
    cp_async_commit();
  }
  for (int i = threadIdx.x; i < 256; i += C::kThreads) scale_lut[i] = scale2(e4m3_value(i));

  RowState<C> st;
  float* row_logit_scale = reinterpret_cast<float*>(smem + C::kRowInfoOffset);
  int* row_pos = reinterpret_cast<int*>(smem + C::kRowInfoOffset + C::kRows * 4);
  st.logit_scale = row_logit_scale;
  st.pos = row_pos;
  load_queries<T, C>(p, t, q_rows, row_logit_scale);  // the rows' powers of two, to scale next
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first_pos = t.seq_len - t.q_len + t.first_token, last_pos = first_pos + t.tokens - 1;
  const float logit_scale = p.softmax_scale * *p.k_global_scale * kValueBias * kLog2e;
  __syncwarp();
  for (int r = warp * C::kWarpRows + lane; r < (warp + 1) * C::kWarpRows; r += 32) {  // the warp's rows
    const int token = r / p.group_size;
    row_pos[r] = token < t.tokens ? first_pos + token : -1;
    row_logit_scale[r] *= logit_scale;
  }
#pragma unroll
  for (int h = 0; h < RowState<C>::kThreadRows; ++h) {
    st.max[h] = -INFINITY;
    st.sum[h] = 0.0f;
  }
#pragma unroll
  for (int rt = 0; rt < C::kRowTiles; ++rt)
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.o[rt][dt][i] = 0.0f;
  // a warp whose rows are all past the tile's tokens only helps copy and dequantize
  const bool warp_live = warp * C::kWarpRows / p.group_size < t.tokens;

  for (int tile = first_tile; tile < end_tile; ++tile) {
    cp_async_wait<C::kStages - 1>();
    __syncthreads();  // the tile's stage has landed, and every warp is done with the last K and V tiles
    dequantize_tile<C>(stage(tile), scale_lut, k_tile, v_tile);
    __syncthreads();  // the tiles are whole, and the stage is free for the copies of tile + kStages
    if (tile + C::kStages < end_tile) issue_copies<C>(p, t, tile + C::kStages, stage(tile));
    cp_async_commit();
    if (warp_live) {
      const int tile_start = tile * C::kTileTokens;
      // only tiles that cross the causal diagonal or the window's edge (for any row) need the mask
      const bool masked = tile_start + C::kTileTokens - 1 > first_pos ||
                          (p.sliding_window > 0 && tile_start <= last_pos - p.sliding_window);
      Scores<C> s;
      tile_scores<C>(smem_addr(q_rows), smem_addr(k_tile), s);
      // the tile's variant, once per tile (per score, the tests and branches cost as much as the math)
      const bool capped = p.logits_soft_cap > 0.0f;
      if (masked) {
        if (capped) online_softmax<true, true>(p, st, s, tile_start); else online_softmax<true, false>(p, st, s, tile_start);
      } else {
        if (capped) online_softmax<false, true>(p, st, s, tile_start); else online_softmax<false, false>(p, st, s, tile_start);
      }
      tile_values<C>(st, s, smem_addr(v_tile));
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue's rows reuse the tiles' space
  store_output<T, C>(p, t, st, reinterpret_cast<float*>(smem));
}

// The launch: the copy width follows the cache's alignment (16-byte pieces where every data row
// allows them; 4 otherwise, e.g. vLLM's inline pages of an odd page_size x kv heads).
template <typename T, int kHeadDim>
cudaError_t launch(const PrefillParams& p, bool rows_16_byte_aligned, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_tiles) * p.num_kv_heads);
  auto run = [&](auto kernel, int smem_bytes) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, Config<kHeadDim, 16>::kThreads, smem_bytes, stream>>>(p);
    return cudaGetLastError();
  };
  if (rows_16_byte_aligned) return run(paged_prefill_kernel<T, kHeadDim, 16>, Config<kHeadDim, 16>::kSmemBytes);
  return run(paged_prefill_kernel<T, kHeadDim, 4>, Config<kHeadDim, 4>::kSmemBytes);
}

template <int kHeadDim>
cudaError_t launch_for_dtype(const PrefillParams& p, cudaStream_t stream) {
  const bool aligned = (reinterpret_cast<uintptr_t>(p.k_data) | reinterpret_cast<uintptr_t>(p.v_data) |
                        p.data_strides.page | p.data_strides.token | p.data_strides.head) % 16 == 0;
  return p.dtype == QueryType::kBFloat16 ? launch<__nv_bfloat16, kHeadDim>(p, aligned, stream)
                                         : launch<__half, kHeadDim>(p, aligned, stream);
}

}  // namespace prefill
}  // namespace nvfp4
