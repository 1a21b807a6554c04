"""When each decode thread block starts, gets its first data, ends its loop and ends: a probe build's
per-block clocks, read back through ctypes.

    git apply results/h200-2026-11-30-4833d5e/timeline/block_clock.patch   # g_probe, nvfp4_probe_read
    python3 scripts/block_timeline.py 64x8192,32x8192,1x131072,128x512 --out timeline.json
    python3 scripts/block_timeline.py 16x8192/1,32x8192/1    # /1: one block per (request, kv head), unsplit

Shape as in `nvfp4-backend bench`: 32 q heads, 8 kv heads, head dim 128, HND pages of 16, bf16,
q_len 1 (--q-len, --layout to change them).  After a warm-up, --mode loop runs 10 calls back to back and
reads the last call's blocks; evict runs one call after the benchmark's L2-evicting read (as its
back-to-back timing does); idle runs one call on an idle GPU after a synchronize (as its isolated
timing does).  The calls are eager launches, not the benchmark's CUDA-graph replays.
Per block the patch records the global timer at start and end (ns, one clock for all SMs) and the
SM's cycle counter at start, at the first stage's data, after the loop (all warps) and at the end.
"""
import argparse
import ctypes
import json
import types

import torch

from nvfp4_backend import bench, jit, layout, ops

def probe_library() -> ctypes.CDLL:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") and "nvfp4" in line}
    for path in paths:
        lib = ctypes.CDLL(path)
        if hasattr(lib, "nvfp4_probe_read"):
            return lib
    raise SystemExit(f"no nvfp4_probe_read in {sorted(paths)}: apply the probe patch first")


def quantiles(xs, qs=(0.0, 0.1, 0.5, 0.9, 1.0)):
    t = torch.tensor(xs, dtype=torch.float64)
    return [round(float(torch.quantile(t, q)), 2) for q in qs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("--out", default="timeline.json")
    ap.add_argument("--mode", choices=("loop", "evict", "idle"), default="loop")
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per request")
    ap.add_argument("--layout", default="HND", choices=layout.LAYOUTS)
    args = ap.parse_args()
    dev, gen = torch.device("cuda"), torch.Generator("cuda").manual_seed(0)
    jit.load(dev)
    lib = probe_library()
    shape = types.SimpleNamespace(q_heads=32, kv_heads=8, head_dim=128, layout=args.layout)
    report = {}
    for case in args.cases.split(","):
        grid, _, forced = case.partition("/")
        B, L = map(int, grid.split("x"))
        batch = bench.uniform_batch(B, L, 16, shape, dev, gen)
        q = torch.randn(B * args.q_len, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=dev, generator=gen)
        call, _, plan, _ = batch.attention(q, args.q_len)
        if forced:
            assert args.q_len == 1, "/1 is for q_len 1"
            assert forced == "1", "only /1 (no split) is supported"
            plan = ops.AttentionPlan(num_splits=1, workspace_bytes=0, heads_per_block=1)
            wsp, out = plan.allocate_workspace(dev), torch.empty_like(q)
            call = lambda: ops.paged_attention(q, batch.cache, batch.table, batch.seq,
                                               torch.arange(B + 1, dtype=torch.int32, device=dev), batch.kg, batch.vg,
                                               batch.scale, max_query_len=1, out=out, plan=plan, workspace=wsp)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        assert lib.nvfp4_probe_clear() == 0
        if args.mode == "loop":
            for _ in range(10):
                call()
        elif args.mode == "evict":
            bench._evict_l2(dev.index or 0)
            call()
        else:
            torch.cuda.synchronize()
            call()
        torch.cuda.synchronize()
        raw = (ctypes.c_uint64 * (8 * 65536))()
        assert lib.nvfp4_probe_read(raw, ctypes.sizeof(raw)) == 0
        # integers until the times are relative: the global timer (~1.8e18 ns) in float64 is only good to 256 ns
        rows = torch.frombuffer(raw, dtype=torch.int64).view(-1, 8)
        rows = rows[(rows[:, 0] > 0) & (rows[:, 1] > 0) & (rows[:, 3] > 0)]  # blocks that ran their loop
        rows[:, :2] -= rows[:, 0].min()
        rows[:, 2:6] -= rows[:, 2:3].clone()
        rows = rows.double()
        g0, g1, c0, c1, c2, c3 = (rows[:, i] for i in range(6))  # c0 is 0: cycles since the block's start
        ghz = float(((c3 - c0) / (g1 - g0)).median())  # cycles per ns
        span = float(g1.max()) / 1e3
        dur = (g1 - g0) / 1e3
        nsm = torch.cuda.get_device_properties(dev).multi_processor_count
        sm = rows[:, 6].long()
        per_sm = torch.zeros(nsm, dtype=torch.float64).index_add_(0, sm, dur)
        ends_sm = torch.zeros(nsm, dtype=torch.float64).scatter_reduce_(0, sm, g1 / 1e3, "amax")
        r = dict(
            blocks=len(rows), splits=plan.num_splits, heads_per_block=plan.heads_per_block,
            span_us=round(span, 2), clock_ghz=round(ghz, 3),
            start_us=quantiles((g0 / 1e3).tolist()), end_us=quantiles((g1 / 1e3).tolist()),
            first_data_us=quantiles(((c1 - c0) / ghz / 1e3).tolist()),
            loop_us=quantiles(((c2 - c1) / ghz / 1e3).tolist()),
            epilogue_us=quantiles(((c3 - c2) / ghz / 1e3).tolist()),
            block_us=quantiles(dur.tolist()),
            sm_block_us_sum=quantiles(per_sm[per_sm > 0].tolist()),  # its blocks' durations added up, per SM
            sm_last_end_us=quantiles(ends_sm[ends_sm > 0].tolist()),
            resident_per_sm=round(float(dur.sum()) / (nsm * span), 2),  # blocks per SM, averaged over the span
            # g_start, g_end (ns from the first block's start), c_start (0), c_first, c_loop, c_end (cycles
            # from the block's start), smid, tiles
            per_block=rows.tolist() if len(rows) <= 2048 else None)
        key = case
        while key in report:  # a case given twice keeps both
            key += "'"
        report[key] = r
        print(f"{case:>9} blocks {r['blocks']:5d} splits {r['splits']} span {r['span_us']:7.1f} us  "
              f"clock {ghz:.2f} GHz  resident blocks per SM {r['resident_per_sm']:.2f}")
        for k in ("start_us", "first_data_us", "loop_us", "epilogue_us", "block_us", "end_us", "sm_block_us_sum",
                  "sm_last_end_us"):
            print(f"{'':>11}{k:15s} min/p10/p50/p90/max {r[k]}")
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
