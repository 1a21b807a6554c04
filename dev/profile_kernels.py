"""The decode and write kernels on the benchmark's shapes, one launch each, for Nsight Compute.

    ncu --set full -k regex:"paged_decode|write_kv" -o $OUT/profile python3 dev/profile_kernels.py

Shape as in `nvfp4-backend bench`: 32 q heads, 8 kv heads, head dim 128, HND pages of 16, bf16, unless
--q-heads, --kv-heads and --head-dim give a model's (bench --zoo's rows); --q-lens runs each grid at each
query length (4: speculative decode); --no-write leaves the writer out.
"""
import argparse
import types

import torch

from nvfp4_backend import ops
from nvfp4_backend.tools import bench
from nvfp4_backend.layout import PagedKVCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="64x8192,128x512")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-lens", default="1", help="query tokens per request, comma-separated")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    shape = types.SimpleNamespace(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim, layout="HND")
    for case in args.grid.split(","):
        B, L = map(int, case.split("x"))
        batch = bench.uniform_batch(B, L, 16, shape, dev, gen)
        for q_len in map(int, args.q_lens.split(",")):
            q = torch.randn(B * q_len, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
            batch.attention(q, q_len)  # plans and runs the op once
            torch.cuda.synchronize()
    if args.no_write:
        print("profiled", args.grid, "at q_len", args.q_lens)
        return
    tokens = 16384
    cache = PagedKVCache.allocate(tokens // 16 + 1, 16, 8, 128, "HND", dev)
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(tokens, device=dev) + 16
    ops.write_kv(k, torch.randn_like(k), slots, cache, torch.tensor(0.01, device=dev), torch.tensor(0.01, device=dev))
    torch.cuda.synchronize()
    print("profiled", args.grid, "and write_kv", tokens, "tokens")


if __name__ == "__main__":
    main()
