"""What reading a byte costs, in time and energy, by access pattern and copy instruction.

The decode's copies cost about 137 pJ per byte read at 64 x 8192 (results/h200-2026-11-30-4731996/),
FlashInfer's BF16 decode the same, a device-to-device copy some 60-80 pJ per byte moved.  This reads
1 GiB as 1 KB chunks (one warp per chunk per step, a page-head's K data at D 128 and page 16) in
each of these ways, each replayed back to back for --seconds while nvidia-smi samples (the helpers of
benchmarks/bench_clock_under_load.py), and prints time, TB/s, SM clock, power and energy per byte above the
idle draw, which it measures before and after (the card warms up):

* ldg: 16-byte loads into registers, whole 128-byte lines per warp instruction, XOR-reduced;
* cp.async-lines: 16-byte cp.async.cg into a 4-stage shared-memory ring per warp, read back and
  reduced, whole lines per instruction;
* cp.async-sectors: the same with the decode's pattern since 9124e57: the chunk as 16 rows of 64
  bytes, a lane pair per row, each instruction whole sectors but every other one;
* cp.async-halves: the decode's pattern before 9124e57: each lane pair takes half of two sectors
  per instruction;
* cp.async-sectors-L2::128B / ::256B: the decode's pattern with an L2 prefetch-size hint;
* cp.async.bulk (SM90 and later): one bulk copy of the whole chunk per step, issued by one lane, its
  completion counted on an mbarrier per stage (what a TMA-fed decode would do);

each with the chunks in order and in a random permutation (pages in random order, as the benchmark
and an engine's allocator give them), over random bytes; and two of them over zeros.  A CUDA
extension built inline (torch.utils.cpp_extension).

    python3 benchmarks/bench_read_energy.py [--seconds 3] [--modes ldg,cp.async-sectors] [--out read_energy.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_clock_under_load import energy_above_idle, idle_watts, run_for, summary  # noqa: E402

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

constexpr int kWarps = 4, kStages = 4;

// kPrefetch: 0, or the L2 prefetch size hint in bytes (.L2::128B / .L2::256B: on a miss, L2 fetches
// that much around the sector from DRAM at once; SM80+)
template <int kPrefetch>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  if constexpr (kPrefetch == 0) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  if constexpr (kPrefetch == 128) asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  if constexpr (kPrefetch == 256) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// 8 blocks per SM (the driver's default): without that bound ptxas held mode 0 to 32 registers and
// consumed its first chunk after 3 of the 8 loads.
// mode 0: ldg, whole lines; 1: cp.async, whole lines; 2: cp.async, rows of 64 bytes by lane pairs,
// whole sectors (the decode since 9124e57); 3: the same, half of two sectors each (the decode before);
// 4: one bulk copy per chunk (cp.async.bulk, SM90+), issued by lane 0, completion on an mbarrier.
// A warp reads chunk order[i] (1 KB: 64 x 16 bytes) at step i, steps grid-stride over the chunks.
template <int kMode, int kPrefetch = 0>
__global__ void __launch_bounds__(kWarps * 32, 8) read_chunks(const uint4* data, const int* order, int chunks,
                                                           uint32_t* sink) {
  __shared__ uint4 ring[kWarps][kStages][64];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kWarps + warp, step = gridDim.x * kWarps;
  uint32_t acc = 0;
  if constexpr (kMode == 0) {
    for (int i = first; i < chunks; i += 4 * step) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {  // 8 loads in flight per thread before the first use
        const int c = i + u * step;
        const uint4* chunk = data + int64_t(order[c < chunks ? c : first]) * 64;
        v[2 * u] = __ldcg(chunk + lane);
        v[2 * u + 1] = __ldcg(chunk + 32 + lane);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  } else if constexpr (kMode == 4) {
#if __CUDA_ARCH__ >= 900
    __shared__ alignas(8) uint64_t bars[kWarps][kStages];  // a stage's copy completes its barrier's phase
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0]));
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&bars[warp][0]));
    if (lane == 0) {
      for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar + 8 * s));
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    int issued = 0;
    auto issue = [&](int i) {
      if (lane == 0 && i < chunks) {
        const uint32_t s = issued % kStages;
        // the warp's generic reads of this stage (ordered by __syncwarp) before the async proxy's write
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 1024;\n" ::"r"(bar + 8 * s) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];\n"
                     ::"r"(base + s * 1024), "l"(data + int64_t(order[i]) * 64), "r"(bar + 8 * s) : "memory");
      }
      ++issued;
    };
    for (int s = 0; s < kStages - 1; ++s) issue(first + s * step);
    int consumed = 0;
    for (int i = first; i < chunks; i += step) {
      const uint32_t s = consumed % kStages, parity = (consumed / kStages) & 1;
      asm volatile("{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                   " @!done bra WAIT_%=;\n}\n" ::"r"(bar + 8 * s), "r"(parity) : "memory");
      const uint4 a = ring[warp][s][lane], b = ring[warp][s][lane + 32];
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
      ++consumed;
      __syncwarp();
      issue(i + (kStages - 1) * step);
    }
#else
    __trap();  // the host runs mode 4 on SM90 and later only
#endif
  } else {
    // the 16-byte pieces lane l copies, first instruction and second: mode 1 pieces l and l + 32; modes
    // 2 and 3 row l / 2 (pieces 4 (l / 2) .. + 3), half l % 2: mode 2 pieces 4 (l / 2) + l % 2 and + 2
    // (a sector per instruction), mode 3 pieces 4 (l / 2) + 2 (l % 2) and + 1 (half of each sector)
    const int p0 = kMode == 1 ? lane : kMode == 2 ? (lane / 2) * 4 + (lane % 2) : (lane / 2) * 4 + (lane % 2) * 2;
    const int p1 = kMode == 1 ? lane + 32 : kMode == 2 ? p0 + 2 : p0 + 1;
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0]));
    int issued = 0;
    auto issue = [&](int i) {
      if (i < chunks) {
        const uint4* chunk = data + int64_t(order[i]) * 64;
        const uint32_t stage = base + (issued % kStages) * 64 * 16;
        cp_async16<kPrefetch>(stage + p0 * 16, chunk + p0);
        cp_async16<kPrefetch>(stage + p1 * 16, chunk + p1);
      }
      asm volatile("cp.async.commit_group;\n" ::);
      ++issued;
    };
    for (int s = 0; s < kStages - 1; ++s) issue(first + s * step);
    int consumed = 0;
    for (int i = first; i < chunks; i += step) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
      __syncwarp();
      const uint4 a = ring[warp][consumed % kStages][lane], b = ring[warp][consumed % kStages][lane + 32];
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
      ++consumed;
      __syncwarp();
      issue(i + (kStages - 1) * step);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
  }
  sink[blockIdx.x * kWarps * 32 + threadIdx.x] = acc;
}

void read_chunks_op(torch::Tensor data, torch::Tensor order, torch::Tensor sink, int64_t mode, int64_t blocks) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int chunks = static_cast<int>(order.numel());
  const auto* d = reinterpret_cast<const uint4*>(data.data_ptr());
  auto* s = reinterpret_cast<uint32_t*>(sink.data_ptr());
  const dim3 grid(static_cast<unsigned>(blocks)), threads(kWarps * 32);
  if (mode == 0) read_chunks<0><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 1) read_chunks<1><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 2) read_chunks<2><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 3) read_chunks<3><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 4) read_chunks<4><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 5) read_chunks<2, 128><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  if (mode == 6) read_chunks<2, 256><<<grid, threads, 0, stream>>>(d, order.data_ptr<int>(), chunks, s);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "read_chunks launch failed");
}
"""
CPP_SRC = "void read_chunks_op(torch::Tensor data, torch::Tensor order, torch::Tensor sink, int64_t mode, int64_t blocks);"
MODES = {"ldg": 0, "cp.async-lines": 1, "cp.async-sectors": 2, "cp.async-halves": 3, "cp.async.bulk": 4,
         "cp.async-sectors-L2::128B": 5, "cp.async-sectors-L2::256B": 6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--blocks-per-sm", type=int, default=8)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--out", default="read_energy.json")
    args = ap.parse_args()
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    device = torch.device("cuda", torch.cuda.current_device())
    ext = load_inline("nvfp4_read_energy", CPP_SRC, cuda_sources=CUDA_SRC, functions=["read_chunks_op"],
                      extra_cuda_cflags=["-O3"], verbose=False)
    chunks = 1 << 20  # 1 GiB of 1 KB chunks
    data = {"random": torch.randint(0, 256, (chunks * 1024,), dtype=torch.uint8, device=device).view(torch.int32),
            "zeros": torch.zeros(chunks * 256, dtype=torch.int32, device=device)}
    blocks = torch.cuda.get_device_properties(device).multi_processor_count * args.blocks_per_sm
    sink = torch.empty(blocks * 128, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(0)
    orders = {"in order": torch.arange(chunks, dtype=torch.int32, device=device),
              "permuted": torch.randperm(chunks, generator=gen).to(torch.int32).to(device)}
    idle_before = idle_watts(3.0)
    print(f"idle: {idle_before:.0f} W", flush=True)
    rows = []
    # random bytes in every way; zeros (which toggle nothing on the memory bus) in two, to see how much
    # of a byte's cost is its data's
    modes = [m for m in args.modes.split(",") if m != "cp.async.bulk" or torch.cuda.get_device_capability(device) >= (9, 0)]
    cases = [("random", m, o) for m in modes for o in orders]
    cases += [case for case in [("zeros", "ldg", "in order"), ("zeros", "cp.async-sectors", "permuted")] if case[1] in modes]
    for data_name, mode_name, order_name in cases:
        src, order, mode = data[data_name], orders[order_name], MODES[mode_name]
        row = summary(f"{data_name} {mode_name} {order_name}",
                      run_for(lambda: ext.read_chunks_op(src, order, sink, mode, blocks), args.seconds))
        rows.append(dict(row, data=data_name, mode=mode_name, order=order_name,
                         tbps=chunks * 1024 / row["us_per_call"] / 1e6))
    idle_after = energy_above_idle(rows, idle_before)
    print(f"idle after: {idle_after:.0f} W; TB/s and pJ per byte above the mean idle draw:", flush=True)
    for row in rows:
        row["pj_per_byte_above_idle"] = row["mj_above_idle"] * 1e9 / (chunks * 1024)
        print(f"  {row['data']:6s} {row['mode']:25s} {row['order']:9s} {row['tbps']:5.2f} {row['pj_per_byte_above_idle']:5.0f}",
              flush=True)
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(device), idle_watts_before=idle_before,
                                              idle_watts_after=idle_after, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
