"""torch.profiler of the extend (prefill) path on a GPU: 1x0x4096 and 8x2048x512 as in
`nvfp4-backend bench --prefill`; host time per call, then the top ops by CUDA time.

    PYTHONPATH=. python3 dev/profile_prefill.py
"""
import argparse

import torch
from profile_step import host_and_wall_us, print_profile  # dev/, beside this script

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
        host, wall = host_and_wall_us(call, iters=10)
        print(f"B={batch_size} C={cached} N={new}: host launch {host:.0f} us/call, wall {wall:.0f} us/call")
        print_profile(call, row_limit=14)


if __name__ == "__main__":
    main()
