"""torch.profiler of the extend (prefill) path on a GPU: 1x0x4096 and 8x2048x512 as in
`nvfp4-backend bench --prefill`; host time per call, then the top ops by CUDA time.

    PYTHONPATH=. python3 dev/profile_prefill.py
"""
import argparse
import time

import torch

from nvfp4_backend.tools import bench


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for batch_size, cached, new in ((1, 0, 4096), (8, 2048, 512)):
        batch = bench.uniform_batch(batch_size, cached + new, 16, args, dev, gen)
        q = torch.randn(batch_size * new, args.q_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
        call, *_ = batch.attention(q, new)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            call()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"B={batch_size} C={cached} N={new}: host launch {1e5 * (t1 - t0):.0f} us/call, "
              f"wall {1e5 * (t2 - t0):.0f} us/call")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
