// Quantize-on-write.  A thread owns one 16-element block of one kv head of K or V and steps
// through tokens: per token it reads 32 contiguous bytes, computes the block scale and the 16
// codes, and writes 8 + 1 bytes.
// Scale rule "6or4" (format.SCALE_RULES) also encodes the block with its maximum mapped to 4 and
// keeps whichever has the smaller squared error.  KV mode "hadamard" first rotates each token-head
// by the fast Walsh-Hadamard transform of format.hadamard_transform: butterflies within a thread's
// block for strides 1..8, across the lanes holding the token-head's other blocks above (they are
// neighbouring lanes of one warp: blocks_per_head divides 32).
// The fp32 operations and their order are the ones nvfp4_backend/format.py documents; the
// __f*_rn intrinsics keep nvcc from contracting or approximating them, so the result is
// bit-identical to the reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <utility>
#include "e2m1.h"
#include "half_types.cuh"
#include "nvfp4_kernels.h"

namespace nvfp4 {
namespace {

constexpr int kBlock = 16;
constexpr int kThreads = 256;

// fp32 -> T -> fp32, round-to-nearest-even: the reference rounds the rotated values to the input dtype
__device__ __forceinline__ float round_to(float x, __half) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float round_to(float x, __nv_bfloat16) { return __bfloat162float(__float2bfloat16_rn(x)); }

// n / d, with a shift when d is a power of two (the usual head counts and page sizes; the branch is
// uniform): a 32-bit division is some 20 instructions in a kernel bound by its instruction count.
__device__ __forceinline__ uint32_t quotient(uint32_t n, uint32_t d) {
  return (d & (d - 1)) == 0 ? n >> (31 - __clz(d)) : n / d;
}

// max that returns NaN when either operand is NaN (fmaxf drops it): the block maximum and the
// NaN test in one instruction per element
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The E4M3 scale for a block maximum mapped onto `target`, its value, and the codes.
struct BlockChoice {
  uint8_t sf_byte;
  float sf_value;
  uint32_t packed[2];
};

// inv_scale: 1/scale per E4M3 byte (0 for a zero scale), the block's table
// kTarget 6 (the standard rule) or 4 (the 6-or-4 rule's alternative: amax * 0.25 rounds as amax / 4 does,
// a power of two)
template <int kTarget>
__device__ __forceinline__ BlockChoice encode_block(const float (&scaled)[kBlock], float amax, const float* inv_scale) {
  static_assert(kTarget == 6 || kTarget == 4, "scale targets");
  BlockChoice c;
  const __nv_fp8_e4m3 sf(kTarget == 6 ? max_over_6(amax) : __fmul_rn(amax, 0.25f));  // RNE, satfinite at 448 (Inf too)
  c.sf_byte = sf.__x;
  c.sf_value = float(sf);
  const float inv = inv_scale[c.sf_byte];
  float q[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) q[i] = __fmul_rn(scaled[i], inv);
  c.packed[0] = e2m1_pack8(q);
  c.packed[1] = e2m1_pack8(q + 8);
  return c;
}

// Squared reconstruction error in element order 0..15, unfused: format._block_sq_error.
__device__ __forceinline__ float block_sq_error(const float (&scaled)[kBlock], const BlockChoice& c) {
  float err = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const float diff = __fsub_rn(scaled[i], __fmul_rn(e2m1_value(c.packed[i / 8] >> (4 * (i % 8))), c.sf_value));
    err = __fadd_rn(err, __fmul_rn(diff, diff));
  }
  return err;
}

// What a thread loads for one 16-element block: the token's slot and the block's source bytes.
// Every in-range token has a source row, skipped ones too, so the data load need not wait for the
// slot (one memory latency instead of two).  Past the last token the slot is -1 and the bytes are
// left unset: nothing stores them (with rotation the lanes still compute on them, and drop the result).
struct Fetched {
  int64_t slot;
  uint4 raw[2];
};

// block_src: the block's first element in the token's row
template <typename T>
__device__ __forceinline__ Fetched fetch(const WriteKVParams& p, const T* block_src, uint32_t token) {
  Fetched f;
  f.slot = -1;
  if (token < static_cast<uint32_t>(p.num_tokens)) {
    f.slot = p.slot_mapping[token];
    f.raw[0] = __ldg(reinterpret_cast<const uint4*>(block_src));
    f.raw[1] = __ldg(reinterpret_cast<const uint4*>(block_src) + 1);
  }
  return f;
}

// A thread's column: the (side, head, block) part of the flat index (token, side, head, block),
// which stays fixed while the thread steps through tokens.
struct Column {
  uint8_t* data;    // the block's bytes in page 0, slot 0
  uint8_t* scales;  // its scale byte there
  int block, blocks_per_head;
  int page_shift;   // log2(page_size), or -1 when the page size is not a power of two
};

// Quantize one fetched block into the cache (or drop it: skipped slot).  With rotation every lane
// of the warp must call it, since the token-head's lanes exchange values.
template <typename T, bool kRotate, bool kSixOrFour>
__device__ __forceinline__ void quantize_block(const WriteKVParams& p, const Column& col, const Fetched& f,
                                               const float* inv_scale, float enc) {
  const int block = col.block, blocks_per_head = col.blocks_per_head;
  const int64_t slot = f.slot;  // -1 past the last token: fetch did not load it
  // the same for all lanes of a token-head; with rotation every lane stays for the shuffles (a
  // skipped token-head's lanes rotate their row too, and drop the result)
  const bool active = slot >= 0 && slot < p.num_slots;
  if (!active && !kRotate) return;
  const uint32_t page_size = static_cast<uint32_t>(p.page_size), slot32 = static_cast<uint32_t>(slot);
  const uint32_t page = !active ? 0u : col.page_shift >= 0 ? slot32 >> col.page_shift : slot32 / page_size;
  const uint32_t in_page = active ? slot32 - page * page_size : 0u;

  float vals[kBlock];
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(f.raw);
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) {
    const float2 v = to_float2(pairs[i], T());
    vals[2 * i] = v.x;
    vals[2 * i + 1] = v.y;
  }
  if constexpr (kRotate) {
#pragma unroll
    for (int h = 1; h < kBlock; h *= 2) {
#pragma unroll
      for (int i = 0; i < kBlock; ++i) {
        if (i & h) continue;
        const float a = vals[i], b = vals[i + h];
        vals[i] = __fadd_rn(a, b);
        vals[i + h] = __fsub_rn(a, b);
      }
    }
    for (int m = 1; m < blocks_per_head; m *= 2) {  // stride 16 m: the block `block ^ m`
      const bool low = (block & m) == 0;
#pragma unroll
      for (int i = 0; i < kBlock; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, vals[i], m);
        vals[i] = low ? __fadd_rn(vals[i], other) : __fsub_rn(other, vals[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kBlock; ++i) vals[i] = round_to(__fmul_rn(vals[i], p.hadamard_scale), T());
    if (!active) return;
  }

  float scaled[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) scaled[i] = __fmul_rn(vals[i], enc);
  // NaN if any scaled value is NaN; a tree, 4 dependent steps instead of a chain of 16
  float tree[kBlock / 2];
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) tree[i] = max_nan(fabsf(scaled[2 * i]), fabsf(scaled[2 * i + 1]));
#pragma unroll
  for (int width = kBlock / 4; width >= 1; width /= 2)
#pragma unroll
    for (int i = 0; i < width; ++i) tree[i] = max_nan(tree[i], tree[i + width]);
  const float amax = tree[0];
  const bool has_nan = isnan(amax);
  BlockChoice choice;
  if (has_nan) {
    choice.sf_byte = 0x7F;  // E4M3 NaN: the block reads back as NaN
    choice.packed[0] = choice.packed[1] = 0u;
  } else {
    choice = encode_block<6>(scaled, amax, inv_scale);
    if constexpr (kSixOrFour) {
      // the maximum-of-4 scale wins only when strictly better: a tie keeps the standard scale
      const BlockChoice four = encode_block<4>(scaled, amax, inv_scale);
      if (block_sq_error(scaled, four) < block_sq_error(scaled, choice)) choice = four;
    }
  }
  // page strides are below 2^32 bytes and a page's tokens span fewer than 2^31 (the binding checks):
  // one 32 x 32 -> 64-bit multiply-add per address
  const auto offset = [&](const PageStrides& s) {
    return uint64_t(page) * static_cast<uint32_t>(s.page) + in_page * static_cast<uint32_t>(s.token);
  };
  *reinterpret_cast<uint2*>(col.data + offset(p.data_strides)) = make_uint2(choice.packed[0], choice.packed[1]);
  col.scales[offset(p.scale_strides)] = choice.sf_byte;
}

// A grid of resident blocks strides over the flat index (token, side, head, block): neighbouring
// threads read neighbouring bytes, and a token-head's blocks sit on neighbouring lanes of one warp.
// The stride is a multiple of the count per token (the launch sees to it), so a thread keeps its
// (side, head, block) and steps through tokens; it loads its next block while it quantizes the
// current one, and the per-block tables are built once per resident block.  32-bit index math (the
// binding keeps thread and slot counts below 2^31): this kernel is bound by its instruction count.
// kRotate: KV mode "hadamard" (p.hadamard); kSixOrFour: scale rule "6or4" (p.scale_rule).
template <typename T, bool kRotate, bool kSixOrFour>
__global__ void __launch_bounds__(kThreads, kSixOrFour ? 3 : 4) write_kv_kernel(const WriteKVParams p) {
  const uint32_t block_bits = 31 - __clz(static_cast<uint32_t>(p.head_dim) / kBlock);
  const uint32_t heads = static_cast<uint32_t>(p.num_kv_heads), per_token = 2u * heads << block_bits;
  const uint32_t total = static_cast<uint32_t>(p.num_tokens) * per_token, stride = gridDim.x * kThreads;
  const uint32_t first = blockIdx.x * kThreads + threadIdx.x;
  uint32_t token = quotient(first, per_token);
  const uint32_t token_step = quotient(stride, per_token);  // exact whenever a thread takes a second step
  const uint32_t side_head = (first - token * per_token) >> block_bits;
  const bool side = side_head >= heads;
  const uint32_t head = side ? side_head - heads : side_head;
  Column col;
  col.block = static_cast<int>(first & ((1u << block_bits) - 1));
  col.blocks_per_head = 1 << block_bits;
  col.page_shift = (p.page_size & (p.page_size - 1)) == 0 ? 31 - __clz(p.page_size) : -1;
  col.data = (side ? p.v_data : p.k_data) + head * p.data_strides.head + col.block * (kBlock / 2);
  col.scales = (side ? p.v_block_scales : p.k_block_scales) + head * p.scale_strides.head + col.block;
  // the block in the thread's current token's row; it steps token_step rows at a time
  const T* src = static_cast<const T*>(side ? p.value : p.key) + head * p.kv_stride_head + col.block * kBlock +
                 int64_t(token) * p.kv_stride_token;
  const int64_t src_step = int64_t(token_step) * p.kv_stride_token;
  Fetched next = fetch<T>(p, src, token);
  // 1/scale for every E4M3 byte and 1/global scale for K and V (the same __fdiv_rn, so the same
  // bits), built while the first loads are in flight
  static_assert(kThreads == 256, "one table entry per thread");
  __shared__ float inv_scale[256];
  __shared__ float encode_scale[2];
  {
    __nv_fp8_e4m3 sf;
    sf.__x = static_cast<__nv_fp8_storage_t>(threadIdx.x);
    const float value = float(sf);
    inv_scale[threadIdx.x] = value > 0.0f ? __fdiv_rn(1.0f, value) : 0.0f;
    if (threadIdx.x < 2) encode_scale[threadIdx.x] = __fdiv_rn(1.0f, __ldg(threadIdx.x ? p.v_global_scale : p.k_global_scale));
  }
  __syncthreads();
  const float enc = encode_scale[side];
  // the loop condition is the same for a whole warp (the rotation's shuffles need every lane)
  for (uint32_t warp_first = first & ~31u; warp_first < total; warp_first += stride) {
    const Fetched current = next;
    token += token_step;
    src += src_step;
    next = fetch<T>(p, src, token);
    quantize_block<T, kRotate, kSixOrFour>(p, col, current, inv_scale, enc);
  }
}

}  // namespace

// Blocks that fit on the device at once, 0 if unknown (queried once per kernel and device: the
// occupancy call costs microseconds).
template <typename Kernel>
int resident_blocks(Kernel kernel) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && cached[device] > 0) return cached[device];
  int per_sm = 0, sms = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // the launch reports its own errors, not this query's
    return 0;
  }
  const int blocks = per_sm * sms;
  if (device < kMaxDevices) cached[device] = blocks;
  return blocks;
}

template <typename T, bool kRotate, bool kSixOrFour>
cudaError_t launch_typed(const WriteKVParams& p, int64_t total, cudaStream_t stream) {
  const auto kernel = write_kv_kernel<T, kRotate, kSixOrFour>;
  const int64_t needed = (total + kThreads - 1) / kThreads;
  // one step per thread (always correct) unless the resident blocks hold a multiple of
  // per_token / gcd(per_token, kThreads) blocks: a stride of a whole number of tokens (the kernel
  // keeps each thread's side, head and block)
  const int64_t resident = resident_blocks(kernel), per_token = total / p.num_tokens;
  int64_t g = per_token, k = kThreads;
  while (k) g = std::exchange(k, g % k);
  const int64_t multiple = per_token / g;
  const int64_t grid = needed > resident && resident >= multiple ? resident / multiple * multiple : needed;
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// One kernel per (dtype, rotation, scale rule): the plain kernel then holds fewer registers than one
// that carries the other modes' code, so more blocks are resident.
template <typename T>
cudaError_t launch_modes(const WriteKVParams& p, int64_t total, cudaStream_t stream) {
  const bool six_or_four = p.scale_rule == ScaleRule::kSixOrFour;
  if (p.hadamard)
    return six_or_four ? launch_typed<T, true, true>(p, total, stream) : launch_typed<T, true, false>(p, total, stream);
  return six_or_four ? launch_typed<T, false, true>(p, total, stream) : launch_typed<T, false, false>(p, total, stream);
}

cudaError_t launch_write_kv(const WriteKVParams& p, cudaStream_t stream) {
  const int64_t total = int64_t(p.num_tokens) * 2 * p.num_kv_heads * (p.head_dim / kBlock);
  if (total == 0) return cudaSuccess;
  return p.dtype == QueryType::kBFloat16 ? launch_modes<__nv_bfloat16>(p, total, stream)
                                         : launch_modes<__half>(p, total, stream);
}

}  // namespace nvfp4
