"""``nvfp4-backend bench --zoo``: the decode kernel at the attention shapes of common models.

Each row of ``ZOO`` is one model shape (q heads / kv heads, head dim) at one batch (B requests of L
cached tokens each), on HND pages of ``PAGE_SIZE`` in random order.  A row is timed by
``bench.bench_case``, the decode benchmark's own case, so it measures what ``nvfp4-backend bench``
measures: our decode (1 query token), our speculative decode (``--spec-q-len`` tokens, 4 by
default), FlashInfer's BF16, FP8 and NVFP4 decode in the same process (the NVFP4 peer on our cache's
bytes; none with ``--no-peers``), and on the rows marked ``hadamard`` our decode of a Hadamard-mode
cache; all CUDA-graph replays timed isolated and back to back (``timing.Timing``).  TB/s is the
NVFP4 cache's bytes over the time for ours, each peer's own cache bytes for the peers (bench.py's
formula).  ``--zoo-rows`` picks a subset (indices or substrings of the labels), so that one device
call can run part of the zoo.

The GPU part (``run_zoo``) only collects rows, and rewrites ``--out`` after each one (a run cut
short keeps what it measured); ``summarize``, ``zoo_table``, ``write_report`` and ``zoo_plot`` turn
them into the printed tables, the JSON and the ``--plot`` PNG, and need no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = "nvfp4-backend-bench-zoo/1"
PAGE_SIZE = 16
LAYOUT = "HND"
PEER_KV = ("bf16", "fp8", "nvfp4")


@dataclass(frozen=True)
class ZooRow:
    """One row of the zoo: a model's attention shape at B requests of L cached tokens."""
    models: str
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    seq_len: int
    hadamard: bool = False  # also time a Hadamard-mode cache (KVMode rotation "hadamard")

    @property
    def group_size(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def label(self) -> str:
        return f"{self.models} {self.q_heads}/{self.kv_heads} D{self.head_dim} {self.batch}x{self.seq_len}"


ZOO = (
    ZooRow("Llama-3.1-8B", 32, 8, 128, 64, 8192, hadamard=True),
    ZooRow("Llama-3.1-70B, Qwen3-32B", 64, 8, 128, 32, 8192),
    ZooRow("Llama-3.1-70B, Qwen3-32B", 64, 8, 128, 1, 131072),
    ZooRow("Qwen2.5-7B", 28, 4, 128, 64, 8192),
    ZooRow("Qwen2.5-7B", 28, 4, 128, 1, 131072),
    ZooRow("Llama-3.1-405B", 128, 8, 128, 32, 8192),
    ZooRow("Llama-3.1-405B", 128, 8, 128, 1, 131072),
    ZooRow("gpt-oss", 64, 8, 64, 64, 8192),
    ZooRow("gpt-oss", 64, 8, 64, 8, 65536),
    ZooRow("Gemma-2-9B", 16, 8, 256, 32, 8192),
    ZooRow("Gemma-2-9B", 16, 8, 256, 1, 131072),
)
"""The zoo, in the order it is run and reported."""


def zoo_listing() -> str:
    return "\n".join(f"  {i:2d}  {row.label}" + ("  (+ hadamard)" if row.hadamard else "") for i, row in enumerate(ZOO))


def select_rows(spec: str | None) -> list[tuple[int, ZooRow]]:
    """(index, row) of the zoo rows that ``--zoo-rows`` names, in the zoo's order: all of them for
    None, "" or "all"; else each comma-separated item is an index into ZOO or a case-insensitive
    substring of a row's label ("D64", "1x131072", "gemma").  An item naming no row is a ValueError."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(enumerate(ZOO))
    chosen = set()
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item.isdigit():
            if int(item) >= len(ZOO):
                raise ValueError(f"--zoo-rows: no row {item} (0..{len(ZOO) - 1})")
            chosen.add(int(item))
            continue
        hits = {i for i, row in enumerate(ZOO) if item.lower() in row.label.lower()}
        if not hits:
            raise ValueError(f"--zoo-rows: {item!r} is in no row's label")
        chosen |= hits
    if not chosen:
        raise ValueError(f"--zoo-rows: {spec!r} names no row")
    return [(i, ZOO[i]) for i in sorted(chosen)]


def zoo_args_error(args) -> str | None:
    """Why these bench arguments cannot run the zoo (with the zoo's rows listed), or None."""
    if args.zoo_rows and not args.zoo:
        return "--zoo-rows needs --zoo"
    try:
        select_rows(args.zoo_rows)
    except ValueError as exc:
        return f"{exc}; the rows:\n{zoo_listing()}"
    return None


def row_args(args, row: ZooRow) -> argparse.Namespace:
    """The bench arguments with this row's shape, layout and KV modes in place of the command line's."""
    return argparse.Namespace(**{**vars(args), "q_heads": row.q_heads, "kv_heads": row.kv_heads,
                                 "head_dim": row.head_dim, "layout": LAYOUT,
                                 "modes": "plain,hadamard" if row.hadamard else "plain"})


def run_zoo(args, device, gen, fi, ws) -> int:
    """Time the selected ZOO rows (GPU), print the tables, write the JSON and the plot; 1 where a
    row failed (the others are still run and reported)."""
    from .bench import _meta, bench_case
    from .bench_report import format_rows
    from .timing import copy_bandwidth

    selected = select_rows(args.zoo_rows)
    copy = copy_bandwidth(device)
    meta = {k: v for k, v in _meta(args, device, fi, copy_tbps=copy).items() if k not in ("q_heads", "kv_heads", "head_dim")}
    meta.update(layout=LAYOUT, page_size=PAGE_SIZE, spec_q_len=args.spec_q_len, iters=args.iters,
                zoo_rows=[i for i, _ in selected], row_seconds={}, failed={})  # keyed by str(index), as in JSON
    print(f"{meta['gpu']}: copy bandwidth {copy:.2f} TB/s (read + write); {len(selected)} of {len(ZOO)} zoo rows, "
          f"FlashInfer peers {'on' if fi is not None else 'off'}", flush=True)
    rows = []
    for n, (i, row) in enumerate(selected):
        print(f"== [{i}] {row.label} ({n + 1}/{len(selected)})", flush=True)
        t0 = time.perf_counter()
        try:
            got = bench_case(row.batch, row.seq_len, PAGE_SIZE, row_args(args, row), device, gen, fi, ws)
        except Exception as exc:  # the other rows still run; a broken CUDA context fails them too, and says so
            meta["failed"][str(i)] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  row {i} failed: {meta['failed'][str(i)]}", file=sys.stderr, flush=True)
            continue
        finally:
            meta["row_seconds"][str(i)] = round(time.perf_counter() - t0, 1)
        for r in got:
            r.update(zoo_index=i, models=row.models, q_heads=row.q_heads, kv_heads=row.kv_heads, head_dim=row.head_dim)
        print(format_rows(got) + f"\n  ({meta['row_seconds'][str(i)]} s)", flush=True)
        rows += got
        write_report(rows, meta, args.out)
    summary = write_report(rows, meta, args.out, args.plot)
    for name, us in (("isolated replays", "us"), ("back-to-back replays (the GPU time of a step)", "us_b2b")):
        print(f"\n{name}:\n" + zoo_table(summary, copy, us))
    return 1 if meta["failed"] else 0


def _key(r: dict) -> tuple:
    return r["zoo_index"], r["models"], r["q_heads"], r["kv_heads"], r["head_dim"], r["B"], r["L"], r["page_size"]


def _times(r: dict | None) -> dict | None:
    return None if r is None else {k: r[k] for k in ("us", "tbps", "us_b2b", "tbps_b2b")}


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and math.isfinite(a) and math.isfinite(b) else math.nan


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per zoo row, in the order run, from bench_case's rows (with the zoo's fields):
    ours (1 query token), spec (q_len > 1: its times and their ratio to ours), peers (FlashInfer per
    kv dtype, None where it did not run), x_peer (peer time / ours, back to back: ours against the
    peer, > 1 where ours is faster) and hadamard (its times and their ratio to plain), each None
    where not measured."""
    out = []
    for key in dict.fromkeys(_key(r) for r in rows):
        sel = [r for r in rows if _key(r) == key]
        mine = [r for r in sel if r["impl"] == "nvfp4-backend"]
        ours = next(r for r in mine if r["q_len"] == 1 and r.get("mode", "plain") == "plain")
        spec = next((r for r in mine if r["q_len"] > 1), None)
        had = next((r for r in mine if r.get("mode") == "hadamard"), None)
        peers = {kv: next((r for r in sel if r["impl"] != "nvfp4-backend" and r["kv"] == kv), None) for kv in PEER_KV}
        index, models, hq, hkv, d, B, L, ps = key
        out.append(dict(
            index=index, label=ZooRow(models, hq, hkv, d, B, L).label, models=models, q_heads=hq, kv_heads=hkv,
            head_dim=d, B=B, L=L, page_size=ps,
            ours={**_times(ours), **{k: ours[k] for k in ("rel_err", "splits", "heads_per_block", "fused") if k in ours}},
            spec=None if spec is None else {
                "q_len": spec["q_len"], **_times(spec),
                "vs_q1": _ratio(spec["us"], ours["us"]), "vs_q1_b2b": _ratio(spec["us_b2b"], ours["us_b2b"])},
            peers={kv: _times(r) for kv, r in peers.items()},
            x_peer={kv: None if r is None else _ratio(r["us_b2b"], ours["us_b2b"]) for kv, r in peers.items()},
            hadamard=None if had is None else {
                **_times(had), "vs_plain": _ratio(had["us"], ours["us"]),
                "vs_plain_b2b": _ratio(had["us_b2b"], ours["us_b2b"])},
        ))
    return out


def _cell(x: float | None, width: int = 8, f: str = ".1f") -> str:
    return f"{x:{width}{f}}" if x is not None and math.isfinite(x) else f"{'-':>{width}s}"


def zoo_table(summary: list[dict], copy: float, us: str = "us_b2b") -> str:
    """The zoo on one timing (``us`` or ``us_b2b``): ours, its TB/s and share of the copy bandwidth,
    the speculative column and its ratio to one token, FlashInfer's times, ours against them (peer
    time / ours), the Hadamard column and its ratio to plain; "-" where not measured."""
    tbps, suffix = us.replace("us", "tbps"), us[2:]
    q = next((s["spec"]["q_len"] for s in summary if s["spec"]), 4)
    lines = [f"{'':>2s} {'models':<24s} {'heads':>7s} {'D':>3s} {'B x L':>12s} {'ours us':>8s} {'TB/s':>5s} "
             f"{'%copy':>5s} {f'q{q} us':>8s} {f'q{q}/q1':>6s} {'fi-bf16':>8s} {'fi-fp8':>8s} {'fi-nvfp4':>8s} "
             f"{'x bf16':>6s} {'x fp8':>6s} {'x nvfp4':>7s} {'hadamard':>8s} {'/plain':>6s}"]
    for s in summary:
        o, sp, had = s["ours"], s["spec"] or {}, s["hadamard"] or {}
        peer = {kv: (s["peers"][kv] or {}).get(us) for kv in PEER_KV}
        x = {kv: _ratio(peer[kv], o[us]) for kv in PEER_KV}
        lines.append(
            f"{s['index']:>2d} {s['models'][:24]:<24s} {s['q_heads']:>3d}/{s['kv_heads']:<3d} {s['head_dim']:3d} "
            f"{s['B']:>5d}x{s['L']:<6d} {o[us]:8.1f} {o[tbps]:5.2f} {o[tbps] / copy:5.0%} "
            f"{_cell(sp.get(us))} {_cell(sp.get('vs_q1' + suffix), 6, '.2f')} "
            f"{_cell(peer['bf16'])} {_cell(peer['fp8'])} {_cell(peer['nvfp4'])} "
            f"{_cell(x['bf16'], 6, '.2f')} {_cell(x['fp8'], 6, '.2f')} {_cell(x['nvfp4'], 7, '.2f')} "
            f"{_cell(had.get(us))} {_cell(had.get('vs_plain' + suffix), 6, '.2f')}")
    return "\n".join(lines)


def write_report(rows: list[dict], meta: dict, out: str | Path, plot: str | Path | None = None) -> list[dict]:
    """Write the JSON (schema, meta, the summary, every timed row) to ``out``, and the plot to
    ``plot`` where given; returns the summary."""
    summary = summarize(rows)
    Path(out).write_text(json.dumps(dict(schema=SCHEMA, meta=meta, zoo=summary, decode=rows), indent=1))
    if plot:
        zoo_plot(summary, meta, plot)
    return summary


def zoo_plot(summary: list[dict], meta: dict, path: str | Path) -> bool:
    """Effective TB/s (back to back) per zoo row, ours and each FlashInfer peer side by side, the copy
    bandwidth as a line.  Without matplotlib: one line saying so, and False."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (the JSON has every number); no {path}")
        return False
    series = [("nvfp4-backend", lambda s: s["ours"])] + [(f"flashinfer {kv}", lambda s, kv=kv: s["peers"][kv])
                                                         for kv in PEER_KV]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(summary)), 5))
    for i, (name, pick) in enumerate(series):
        vals = [(pick(s) or {}).get("tbps_b2b", math.nan) for s in summary]
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(summary))], vals, width, label=name)
    if meta.get("copy_tbps"):
        ax.axhline(meta["copy_tbps"], color="gray", linestyle="--", label="copy bandwidth")
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels([f"{s['models']}\n{s['q_heads']}/{s['kv_heads']} D{s['head_dim']}\n{s['B']}x{s['L']}"
                        for s in summary], fontsize=7)
    ax.set_ylabel("effective bandwidth, back to back (TB/s)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{meta.get('gpu', '?')}: decode at model shapes, {meta.get('layout', LAYOUT)} pages of "
                 f"{meta.get('page_size', PAGE_SIZE)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
