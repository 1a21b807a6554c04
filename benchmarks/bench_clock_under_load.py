"""The SM clock and power while a kernel runs for seconds, sampled by nvidia-smi every 50 ms.

Per-SM rates measured in the tuning notes (tiles per microsecond) assume a clock; if the card
lowers it under a load (power, temperature), instruction counts and occupancy read differently.
This runs, one after another, each for --seconds: our decode (D 128, group 4, page 16) at
1 x 131072, 128 x 512 and 64 x 8192 (also with 4 query tokens), FlashInfer's BF16 decode at 64 x 8192
when it is importable, the writer (16K tokens), and a device-to-device copy of random bytes and of
zeros (HBM's energy per byte depends on the data: benchmarks/bench_read_energy.py); each as CUDA-graph replays
back to back.  decode-64x8192-written is the 64 x 8192 decode on a cache that the writer filled from
Gaussian keys and values (codes and scales distributed roughly as a model's) instead of the
benchmark's uniformly random codes and scale bytes in 0x28-0x47, right after the random cache's run,
to see how much of the decode's power is the data's.  Prints per load the median and
range of the sampled SM clock and power draw, nvidia-smi's active clock-event reasons, and the time
per call over the whole run (replays back to back, L2 warm: not the benchmark's timing), and the
energy per call above the idle draw, measured before and after the loads.

    python3 benchmarks/bench_clock_under_load.py [--seconds 4] [--loads decode-64x8192,copy] [--out clocks.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nvfp4_backend import ops  # noqa: E402
from nvfp4_backend.layout import PagedKVCache  # noqa: E402
from nvfp4_backend.tools import bench  # noqa: E402

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


LOADS = ("decode-1x131072", "decode-128x512", "decode-64x8192-q4", "decode-64x8192", "decode-64x8192-written",
         "flashinfer-bf16", "write", "copy", "copy-zeros")


def sampled(action) -> list[dict]:
    """nvidia-smi's samples (every 50 ms) while action() runs.  Its power.draw averages over about a
    second, and the clock ramps: the first 1.2 s (24 samples), or the first fifth if more, are dropped."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    action()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines[max(len(lines) // 5, 24):]:
        parts = [x.strip() for x in line.split(",")]
        try:
            samples.append(dict(sm_mhz=float(parts[0]), watts=float(parts[1]), temp_c=float(parts[2]), reasons=parts[3]))
        except (ValueError, IndexError):
            continue
    if not samples:
        raise RuntimeError("nvidia-smi gave no samples")
    return samples


def seeded(device) -> torch.Generator:
    """A generator seeded alike for every load: a load's data do not depend on which others ran."""
    return torch.Generator(device=device).manual_seed(0)


def idle_watts(seconds: float) -> float:
    """The median power draw with nothing running, sampled for `seconds`."""
    torch.cuda.synchronize()
    return statistics.median(s["watts"] for s in sampled(lambda: time.sleep(seconds)))


def energy_above_idle(rows: list[dict], idle_before: float) -> float:
    """Measures the idle draw again and gives each summary() row its energy per call above the mean of
    the draws before and after (the card warms up over the runs): the idle draw after."""
    idle_after = idle_watts(3.0)
    idle = (idle_before + idle_after) / 2
    for row in rows:
        row["mj_above_idle"] = (row["watts_median"] - idle) * row["us_per_call"] * 1e-3
    return idle_after


def run_for(fn, seconds: float) -> tuple[list[dict], float]:
    """Replay fn (captured 20 times in one graph) for `seconds` while nvidia-smi samples: the
    samples, and the microseconds per call."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    us_per_call = 0.0

    def replay() -> None:
        nonlocal us_per_call
        start = time.time()
        replays = 0
        while time.time() < start + seconds:
            for _ in range(10):
                graph.replay()
            replays += 10
            torch.cuda.synchronize()
        us_per_call = (time.time() - start) / (replays * 20) * 1e6

    return sampled(replay), us_per_call


def summary(name: str, run: tuple[list[dict], float]) -> dict:
    samples, us_per_call = run
    mhz = [s["sm_mhz"] for s in samples]
    watts = [s["watts"] for s in samples]
    reasons = sorted({s["reasons"] for s in samples})
    row = dict(load=name, samples=len(samples), sm_mhz_median=statistics.median(mhz), sm_mhz_min=min(mhz),
               sm_mhz_max=max(mhz), watts_median=statistics.median(watts), watts_max=max(watts), reasons=reasons,
               us_per_call=us_per_call)
    print(f"{name:28s} {us_per_call:7.1f} us/call, SM {row['sm_mhz_median']:.0f} MHz ({row['sm_mhz_min']:.0f}-{row['sm_mhz_max']:.0f}), "
          f"{row['watts_median']:.0f} W (max {row['watts_max']:.0f}), reasons {','.join(reasons)}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma list of {', '.join(LOADS)}")
    ap.add_argument("--out", default="clocks.json")
    args = ap.parse_args()
    loads = args.loads.split(",")
    unknown = sorted(set(loads) - set(LOADS))
    if unknown:
        ap.error(f"--loads: unknown {unknown}; choose from {', '.join(LOADS)}")
    device = torch.device("cuda", torch.cuda.current_device())
    shape = argparse.Namespace(q_heads=32, kv_heads=8, head_dim=128, layout="HND")
    rows = []
    idle_before = idle_watts(3.0)
    print(f"idle: {idle_before:.0f} W", flush=True)

    for B, L in ((1, 131072), (128, 512)):
        if f"decode-{B}x{L}" not in loads:
            continue
        gen = seeded(device)
        other = bench.uniform_batch(B, L, 16, shape, device, gen)
        call, *_ = other.attention(torch.randn(B, 32, 128, dtype=torch.bfloat16, device=device, generator=gen), 1)
        rows.append(summary(f"nvfp4 decode {B}x{L}", run_for(call, args.seconds)))
        del other, call
    if {"decode-64x8192-q4", "decode-64x8192", "decode-64x8192-written", "flashinfer-bf16"} & set(loads):
        at_64x8192(loads, shape, device, args.seconds, rows)
    if "write" in loads:
        write_kv(device, args.seconds, rows)
    for name in ("copy", "copy-zeros"):
        if name in loads:
            src = torch.zeros(1 << 30, dtype=torch.uint8, device=device)
            if name == "copy":
                src.random_(0, 256, generator=seeded(device))
            dst = torch.zeros_like(src)
            rows.append(summary(f"{name} 1 GiB", run_for(lambda: dst.copy_(src), args.seconds)))
            del src, dst
    idle_after = energy_above_idle(rows, idle_before)
    print(f"idle after: {idle_after:.0f} W; energy per call above the mean idle draw:", flush=True)
    for row in rows:
        print(f"  {row['load']:28s} {row['mj_above_idle']:7.2f} mJ", flush=True)
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(device), idle_watts_before=idle_before,
                                              idle_watts_after=idle_after, rows=rows), indent=1))
    return 0


def at_64x8192(loads, shape, device, seconds: float, rows: list) -> None:
    """Our decode (q_len 4 and 1) on one 64 x 8192 cache of random bytes, then on that cache rewritten
    from Gaussian data; FlashInfer's BF16 decode on its own cache with the same page table."""
    gen = seeded(device)
    batch = bench.uniform_batch(64, 8192, 16, shape, device, gen)
    q4 = torch.randn(64 * 4, 32, 128, dtype=torch.bfloat16, device=device, generator=gen)
    q = torch.randn(64, 32, 128, dtype=torch.bfloat16, device=device, generator=gen)
    if "decode-64x8192-q4" in loads:
        call, *_ = batch.attention(q4, 4)
        rows.append(summary("nvfp4 decode 64x8192 q_len 4", run_for(call, seconds)))
    if "decode-64x8192" in loads:
        call, *_ = batch.attention(q, 1)
        rows.append(summary("nvfp4 decode 64x8192", run_for(call, seconds)))
    if "decode-64x8192-written" in loads:  # next to the random cache's run: the card as warm
        write_gaussian(batch.cache, batch.kg, batch.vg, gen)
        call, *_ = batch.attention(q, 1)
        rows.append(summary("nvfp4 decode 64x8192 written", run_for(call, seconds)))

    fi = bench.load_flashinfer() if "flashinfer-bf16" in loads else None
    if fi is not None:
        ws = torch.zeros(512 << 20, dtype=torch.uint8, device=device)
        kc, vc, dt, kw, _ = bench.flashinfer_kv("bf16", batch.cache, "HND", batch.kg, batch.vg, device)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=True)
        w.plan(*batch.flashinfer_paging(), 32, 8, 128, 16, q_data_type=torch.bfloat16, kv_data_type=dt)
        out = torch.empty_like(q)
        rows.append(summary("flashinfer bf16 64x8192", run_for(lambda: w.run(q, (kc, vc), out=out, **kw), seconds)))
        del kc, vc, ws
    del batch
    torch.cuda.empty_cache()


def write_gaussian(cache: PagedKVCache, k_global_scale, v_global_scale, gen: torch.Generator) -> None:
    """Every slot of the cache rewritten by the writer from standard-normal keys and values (with the
    benchmark's global scales, 0.02 and 0.03, the E4M3 block scales come out around 16 and 11)."""
    chunk = 1 << 16
    for first in range(0, cache.num_slots, chunk):
        slots = torch.arange(first, min(first + chunk, cache.num_slots), device=cache.device)
        k = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, dtype=torch.bfloat16, device=cache.device,
                        generator=gen)
        ops.write_kv(k, torch.randn(k.shape, dtype=k.dtype, device=k.device, generator=gen), slots, cache,
                     k_global_scale, v_global_scale)


def write_kv(device, seconds: float, rows: list) -> None:
    tokens = 16384
    cache = PagedKVCache.allocate(tokens // 16 + 1, 16, 8, 128, "HND", device)
    gen = seeded(device)
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=device, generator=gen)
    v = torch.randn(k.shape, dtype=k.dtype, device=device, generator=gen)
    slots = torch.randperm(tokens, device=device, generator=gen) + 16
    kg = torch.tensor(0.01, device=device)
    rows.append(summary("nvfp4 write_kv 16K tokens", run_for(lambda: ops.write_kv(k, v, slots, cache, kg, kg), seconds)))


if __name__ == "__main__":
    sys.exit(main())
