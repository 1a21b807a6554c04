"""GPU timing as the benchmark does it: CUDA-graph replays timed with device events, isolated and back
to back (``Timing``), and the device-to-device copy bandwidth the results are compared with."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median microseconds of one call, timed two ways.

    isolated: each replay alone between two events, the GPU idle before it, so the time includes the
    replay's launch latency (a few us) and finds in L2 whatever the previous replay left there (a
    decode cache is mostly larger than L2; the writer's 64 MB input is not); the issue's peer table
    was measured this way.
    back_to_back: replays enqueued ahead of the GPU (no launch gap), each after a read of 256 MB that
    evicts what the previous one left in L2 (a read, so no dirty lines are written back during the
    timed call): the GPU time an engine's step spends on the call."""
    isolated: float
    back_to_back: float


_L2_FLUSH: dict = {}


def _evict_l2(device) -> None:
    buf = _L2_FLUSH.get(device)
    if buf is None:
        buf = _L2_FLUSH[device] = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MB, 5x the L2
    buf.sum()


def time_graph(fn, iters: int = 50, capture: bool = True, back_to_back: bool = True) -> Timing:
    """Medians of one CUDA-graph replay of fn (eager when capture is off or fails), see Timing;
    back_to_back=False skips that timing (its field is then NaN)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if capture:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                fn()
                with torch.cuda.graph(graph, stream=stream):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            run = graph.replay
        except Exception as exc:  # a peer that cannot be captured is timed eagerly, and said so
            print(f"  (graph capture failed: {type(exc).__name__}; timing eagerly)", file=sys.stderr)
    for _ in range(3):
        run()
    event = lambda: torch.cuda.Event(enable_timing=True)
    isolated = []
    for _ in range(iters):
        s, e = event(), event()
        s.record()
        run()
        e.record()
        e.synchronize()
        isolated.append(s.elapsed_time(e) * 1e3)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    if not back_to_back:
        return Timing(median(isolated), math.nan)
    device = torch.cuda.current_device()
    pairs = [(event(), event()) for _ in range(iters)]
    for s, e in pairs:
        _evict_l2(device)  # GPU work of its own: the host enqueues the next replay meanwhile
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return Timing(median(isolated), median([s.elapsed_time(e) * 1e3 for s, e in pairs]))


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 4 GiB, bytes read + written / time (the ceiling we compare with)."""
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    e.synchronize()
    return 2 * x.numel() * x.element_size() * 10 / (s.elapsed_time(e) * 1e-3) / 1e12
