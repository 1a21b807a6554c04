"""Where one engine step's time goes: `bench --step`'s mixes on our prefill-kernel path, eagerly.

Per mix: the host's time per call (Python and launches: what an engine that runs attention outside
CUDA graphs pays every layer), the wall time per call, and each kernel's CUDA time from
torch.profiler.  With --ncu one call runs between cudaProfilerStart/Stop, for Nsight Compute:

    PYTHONPATH=. python3 dev/profile_step.py --mixes 1,5
    ncu --set full --import-source yes --profile-from-start off -k regex:"paged_prefill|paged_decode" \\
        -o $OUT/profile_step python3 dev/profile_step.py --mixes 1,5 --ncu
"""
import argparse
import time

import torch

from nvfp4_backend.tools import bench_step


def host_and_wall_us(call, iters: int = 20) -> tuple[float, float]:
    """Per call: the host's time to issue it, and the wall time to finish it, back to back."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / iters, 1e6 * (t2 - t0) / iters


def print_profile(call, sort_by: tuple[str, ...] = ("cuda_time_total",), row_limit: int = 12) -> None:
    """torch.profiler's tables of five calls, one per sort key."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    for key in sort_by:
        print(prof.key_averages().table(sort_by=key, row_limit=row_limit, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixes", default="1,5", help="indices into bench_step.MIXES (default %(default)s)")
    parser.add_argument("--ncu", action="store_true", help="one call per mix between cudaProfilerStart/Stop")
    args = parser.parse_args()
    device = torch.device("cuda")
    for index in map(int, args.mixes.split(",")):
        mix = bench_step.MIXES[index]
        gen = torch.Generator(device=device)
        gen.manual_seed(index)
        step = bench_step.make_step(mix, device, gen)
        call, check, _ = bench_step.ours(step, device, gen)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        host, wall = host_and_wall_us(call)
        print(f"[{index}] {mix.name}: host {host:.0f} us/call, wall {wall:.0f} us/call eagerly, "
              f"rel err {check():.1e}")
        print_profile(call, ("cuda_time_total", "self_cpu_time_total"))
        del step, call, check
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
