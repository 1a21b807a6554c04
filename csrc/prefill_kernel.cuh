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
#include "prefill_config.cuh"
#include "prefill_load.cuh"
#include "prefill_tile.cuh"

namespace nvfp4 {
namespace prefill {

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
  const int first_pos = t.seq_len - t.q_len + t.first_token;
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
  // The positions the warp's rows see: [warp_lo, warp_hi].  A KV tile outside them changes none of its
  // rows (their weights there are exactly 0), so the warp only helps copy and dequantize it, as a warp
  // whose rows are all past the block's tokens does for every tile.  With a window, most of a short
  // window's tiles are partly outside each warp's few tokens; without one, the diagonal's last tile
  // lies past the first warps' tokens.  Within [warp_lo, warp_hi], only tiles that cross the warp's
  // causal diagonal or its window's edge need the mask.
  const int warp_first = warp * C::kWarpRows / p.group_size;
  const int warp_last = min(((warp + 1) * C::kWarpRows - 1) / p.group_size, t.tokens - 1);
  const int warp_hi = warp_first < t.tokens ? first_pos + warp_last : -1;
  const int warp_lo = p.sliding_window > 0 ? first_pos + warp_first - p.sliding_window + 1 : 0;

  for (int tile = first_tile; tile < end_tile; ++tile) {
    cp_async_wait<C::kStages - 1>();
    __syncthreads();  // the tile's stage has landed, and every warp is done with the last K and V tiles
    dequantize_tile<C>(stage(tile), scale_lut, k_tile, v_tile);
    __syncthreads();  // the tiles are whole, and the stage is free for the copies of tile + kStages
    if (tile + C::kStages < end_tile) issue_copies<C>(p, t, tile + C::kStages, stage(tile));
    cp_async_commit();
    const int tile_start = tile * C::kTileTokens;
    if (tile_start <= warp_hi && tile_start + C::kTileTokens - 1 >= warp_lo) {
      const bool masked = tile_start + C::kTileTokens - 1 > first_pos + warp_first ||
                          (p.sliding_window > 0 && tile_start <= warp_hi - p.sliding_window);
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
