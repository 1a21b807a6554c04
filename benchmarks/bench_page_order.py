"""Decode time by the order of a cache's pages: does page 1 cost its tokens' scatter or the page size?

    python3 benchmarks/bench_page_order.py [--grid 64x8192,1x131072] [--page-sizes 1,16]

Shape as in `nvfp4-backend bench` (32 q heads, 8 kv heads, D 128, HND, bf16, q_len 1), the same
random cache bytes; only the block table differs:
  random       the benchmark's order: every page anywhere in the cache;
  interleaved  page i of request r at i * B + r (+ 1 here and below: page 0 stays unused, as in the
               benchmark): what a pool that hands out free slots in order gives
               when every request grows by a token per step (SGLang's token pool at page 1);
  contiguous   request r's pages one after another.
Prints isolated / back-to-back us per order (medians of CUDA-graph replays, `tools.timing.time_graph`).
"""
import argparse
import json
import types

import torch

from nvfp4_backend.tools import bench
from nvfp4_backend.tools.timing import time_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="64x8192,1x131072")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    shape = types.SimpleNamespace(q_heads=32, kv_heads=8, head_dim=128, layout="HND")
    rows = []
    for case in args.grid.split(","):
        B, L = map(int, case.split("x"))
        for page_size in map(int, args.page_sizes.split(",")):
            batch = bench.uniform_batch(B, L, page_size, shape, dev, gen)
            npp = batch.table.shape[1]
            i = torch.arange(npp, device=dev, dtype=torch.int32)
            r = torch.arange(B, device=dev, dtype=torch.int32)[:, None]
            orders = {"random": batch.table.clone(),
                      "interleaved": (i[None, :] * B + r + 1).to(torch.int32),
                      "contiguous": (r * npp + i[None, :] + 1).to(torch.int32)}
            q = torch.randn(B, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
            for name, table in orders.items():
                batch.table = table
                call = batch.attention(q, 1)[0]
                t = time_graph(call, args.iters)
                rows.append(dict(B=B, L=L, page_size=page_size, order=name, us=t.isolated, us_b2b=t.back_to_back))
                print(f"B={B:4d} L={L:6d} ps={page_size:3d} {name:12s} {t.isolated:8.1f} / {t.back_to_back:8.1f} us",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
