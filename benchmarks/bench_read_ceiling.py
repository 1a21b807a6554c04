"""How fast plain torch streaming runs at the decode grids' sizes, timed as the benchmark times (isolated
replays and back to back, nvfp4_backend.tools.timing.time_graph): a read-only reduction and a copy of the same
bytes.  Whether the isolated timing of a ~50-200 us kernel can reach the copy ceiling at all.  Compare
with the sum: the graph-captured copy ran far below the benchmark's eager 4 GiB copy on an H200 (2.4-2.8
against 4.29 TB/s, results/h200-2026-12-01-bc5c76e/), for reasons not examined.

    python3 benchmarks/bench_read_ceiling.py [--mb 75.5,151,604,2416]
"""
import argparse

import torch

from nvfp4_backend.tools.timing import copy_bandwidth, time_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="75.5,151,604,2416", help="sizes in MB (1e6 bytes) read per call")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {copy_bandwidth(dev):.2f} TB/s (4 GiB, read + write)")
    print(f"{'MB':>7} {'op':>5} {'isolated us':>12} {'TB/s':>6} {'b2b us':>8} {'TB/s':>6}")
    for mb in (float(x) for x in args.mb.split(",")):
        n = int(mb * 1e6) // 4
        x = torch.randn(n, device=dev)
        total = torch.empty((), device=dev)
        half_dst = torch.empty(n // 2, device=dev)
        ops = {"sum": (lambda: torch.sum(x, dim=0, out=total), n * 4),
               "copy": (lambda: half_dst.copy_(x[: n // 2]), n * 4)}  # half read + half written: the same bytes
        for name, (fn, nbytes) in ops.items():
            t = time_graph(fn, args.iters)
            print(f"{mb:7.1f} {name:>5} {t.isolated:12.1f} {nbytes / t.isolated / 1e6:6.2f} "
                  f"{t.back_to_back:8.1f} {nbytes / t.back_to_back / 1e6:6.2f}", flush=True)
        del x, half_dst


if __name__ == "__main__":
    main()
