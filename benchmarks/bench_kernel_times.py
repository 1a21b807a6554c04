"""Per-kernel CUDA times (torch.profiler) of the decode op: the decode and split-merge kernels apart.

    python3 benchmarks/bench_kernel_times.py 1x131072,128x512

Shape as in `nvfp4-backend bench`: 32 q heads, 8 kv heads, head dim 128, HND pages of 16, bf16, q_len 1;
20 eager calls after 5 warm-up calls, mean device time per kernel.  The benchmark's CUDA-graph times
add the launch overhead (a few us) to the sum of these.
"""
import collections
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

from nvfp4_backend.tools import bench


def main() -> None:
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    shape = types.SimpleNamespace(q_heads=32, kv_heads=8, head_dim=128, layout="HND")
    for case in sys.argv[1].split(","):
        B, L = map(int, case.split("x"))
        batch = bench.uniform_batch(B, L, 16, shape, dev, gen)
        q = torch.randn(B, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
        call = batch.attention(q, 1)[0]
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name.split("(")[0]].append(e.device_time_total)
        for name, t in times.items():
            print(f"{case:>10} {name:70s} n={len(t):3d} mean {sum(t) / len(t):8.1f} us")


if __name__ == "__main__":
    main()
