"""Where token-major (NHD) pages lose time: the data rows or the block scales?

    python3 benchmarks/bench_nhd_views.py [--grid 64x8192,1x131072,128x512] [--page-sizes 16,64] [--hpb 0,1,2,4]

Shape as in `nvfp4-backend bench` (by default 32 q heads, 8 kv heads, D 128, bf16, q_len 1, pages
in random order).  One HND and one NHD cache of random bytes; each combination of their data and scale views
is timed (the kernel takes data and scale strides separately), with the planner's heads per block
(0) and the ones given.  Prints isolated / back-to-back us (medians of CUDA-graph replays,
`tools.timing.time_graph`).  --once calls each variant once, untimed, for
`ncu --kernel-name regex:paged_decode` to count its memory traffic.
"""
import argparse
import json
import types

import torch

from nvfp4_backend.layout import PagedKVCache
from nvfp4_backend.tools import bench
from nvfp4_backend.tools.timing import time_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="64x8192,1x131072,128x512")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--hpb", default="0,1,2,4", help="heads per block; 0: the planner's choice")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--combos", default="HND/HND,HND/NHD,NHD/HND,NHD/NHD", help="data/scales layouts")
    ap.add_argument("--pad-heads", default="0", help="NHD rows padded by these many heads' bytes (a probe of strides)")
    ap.add_argument("--once", action="store_true", help="one eager call per variant, no timing (for ncu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    rows = []
    for case in args.grid.split(","):
        B, L = map(int, case.split("x"))
        for page_size in map(int, args.page_sizes.split(",")):
            caches = {}
            for layout in ["HND"] + [f"NHD+{pad}" if int(pad) else "NHD" for pad in args.pad_heads.split(",")]:
                pad = int(layout.partition("+")[2] or 0)
                shape = types.SimpleNamespace(q_heads=args.q_heads, kv_heads=args.kv_heads + pad, head_dim=args.head_dim,
                                              layout=layout[:3])
                batch = bench.uniform_batch(B, L, page_size, shape, dev, gen)
                c = batch.cache  # the first kv_heads heads of each padded row
                caches[layout] = PagedKVCache(*(t[:, :, :args.kv_heads] for t in c.tensors()))
            q = torch.randn(B, args.q_heads, args.head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
            for combo in args.combos.split(","):
                data, scales = combo.split("/")
                if data not in caches or scales not in caches:
                    continue
                d, s = caches[data], caches[scales]
                batch.cache = PagedKVCache(d.k_data, s.k_block_scales, d.v_data, s.v_block_scales)
                for hpb in map(int, args.hpb.split(",")):
                    call, _, plan, _ = batch.attention(q, 1, heads_per_block=hpb or None)  # calls once
                    if args.once:
                        print(f"B={B} L={L} ps={page_size} data={data} scales={scales} hpb={plan.heads_per_block}")
                        continue
                    t = time_graph(call, args.iters)
                    rows.append(dict(q_heads=args.q_heads, kv_heads=args.kv_heads, B=B, L=L, page_size=page_size, data=data,
                                     scales=scales, hpb=plan.heads_per_block, splits=plan.num_splits, planned=hpb == 0, us=t.isolated, us_b2b=t.back_to_back))
                    print(f"Hq={args.q_heads} Hkv={args.kv_heads} B={B:4d} L={L:6d} ps={page_size:3d} data={data} scales={scales} "
                          f"hpb={plan.heads_per_block}{'*' if hpb == 0 else ' '} splits={plan.num_splits:3d} "
                          f"{t.isolated:8.1f} / {t.back_to_back:8.1f} us", flush=True)
            del caches, batch
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
