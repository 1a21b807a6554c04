"""``nvfp4-backend bench``: the decode kernel vs FlashInfer's BF16 / FP8 / NVFP4 decode, one process.

Every implementation runs on caches of the same shape (the NVFP4 peer on the very same bytes),
timed as CUDA-graph replays with device events (median of many), two ways (``Timing``).  Effective
bandwidth = the KV bytes the format must read / time.  Prints a table per timing, writes JSON and a
PNG plot (isolated times).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import capabilities, ops, planner, reference
from .. import format as fmt
from ..dense_prefill import DensePrefill
from ..layout import PagedKVCache
from ..modes import KVMode
from .bench_report import format_rows, mode_table, plot, summary_table
from .timing import Timing, copy_bandwidth, time_graph

DEFAULT_GRID = [(64, 8192), (256, 2048), (32, 8192), (8, 32768), (1, 131072), (128, 512), (16, 16384)]


def add_arguments(p) -> None:
    p.add_argument("--grid", default=None, help="BxL pairs, e.g. 64x8192,1x131072 (default: a 7-point grid)")
    p.add_argument("--page-sizes", default="16,64")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="HND", choices=["NHD", "HND"])
    p.add_argument("--spec-q-len", type=int, default=4, help="also time q_len tokens per request (0: skip)")
    p.add_argument("--no-peers", action="store_true", help="skip FlashInfer even if importable")
    p.add_argument("--peer-kv", default="bf16,fp8,nvfp4",
                   help="FlashInfer's cache dtypes for --prefill and --step (each JIT-builds its own kernels)")
    p.add_argument("--modes", default="plain",
                   help="KV modes to time (comma list of plain, 6or4, hadamard, hadamard-6or4): decode and write cost")
    task = p.add_mutually_exclusive_group()
    task.add_argument("--prefill", default=None,
                      help="time extends instead of decode: BxCxN triples (B requests, C cached tokens, N new "
                           "tokens), e.g. 1x0x4096,1x12288x4096,8x2048x512 (prefill and chunked prefill); a suffix "
                           "adds features: 1x0x16384:w4096+sinks, 4x0x4096:cap50")
    task.add_argument("--step", default=None, nargs="?", const="all",
                      help="time engine steps mixing decodes and prefill chunks (bench_step.MIXES; 'all' or "
                           "indices, e.g. 0,3) against FlashInfer's same step")
    task.add_argument("--zoo", action="store_true",
                      help="time decode at common models' attention shapes (bench_zoo.ZOO: each row's own heads, "
                           "head dim and B x L, HND pages of 16) against FlashInfer; --grid, --page-sizes, "
                           "--q-heads, --kv-heads, --head-dim, --layout and --modes do not apply")
    p.add_argument("--zoo-rows", default=None,
                   help="with --zoo: only these rows, a comma list of indices into bench_zoo.ZOO and/or "
                        "case-insensitive substrings of their labels, e.g. 0,3 or D64,131072 or Gemma")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--blocks-per-sm", type=int, default=None,
                   help="override the split planner's target for plain decode at D <= 128 (planner.SPLIT_BLOCKS_PER_SM); "
                        "the targets of the other kernels, and the heads-per-block picker's wave, scale with it (planner.blocks_per_sm)")
    p.add_argument("--heads-per-block", type=int, default=None,
                   help="kv heads per decode thread block for q_len 1 (1, 2, 4; 8 with --fused on; default: the "
                        "planner's choice)")
    p.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                   help="the fused decode kernel: the planner's choice (auto), always where it fits (on), never (off)")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--plot", default="bench.png")


def random_nvfp4_cache(num_pages, page_size, kv_heads, head_dim, layout, device, gen) -> PagedKVCache:
    cache = PagedKVCache.allocate(num_pages, page_size, kv_heads, head_dim, layout, device)
    for t in (cache.k_data, cache.v_data):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=device, generator=gen))
    for t in (cache.k_block_scales, cache.v_block_scales):
        t.copy_(torch.randint(0x28, 0x48, t.shape, dtype=torch.uint8, device=device, generator=gen))
    return cache


def load_flashinfer():
    """FlashInfer, or None (and why, on stderr) where it does not import."""
    try:
        import flashinfer
        return flashinfer
    except Exception as exc:
        print(f"FlashInfer peers unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


@dataclass
class UniformBatch:
    """B requests of seq_len cached tokens each on pages in random order, with the scales every
    implementation in one comparison gets."""
    cache: PagedKVCache
    table: torch.Tensor
    seq: torch.Tensor
    seq_len: int
    kg: torch.Tensor
    vg: torch.Tensor
    scale: float

    @property
    def batch_size(self) -> int:
        return self.table.shape[0]

    def attention(self, q: torch.Tensor, q_len: int, cache: PagedKVCache | None = None,
                  heads_per_block: int | None = None, fused: bool | None = None, dense: bool = False, **features):
        """Our op on q (q_len rows per request), planned and run once: (call, out, plan, qsl);
        features: sliding_window, logits_soft_cap, sinks.  dense: plan the long requests on the dense
        prefill path (``dense_prefill``), with the K global scale on the host as the engines pass it."""
        cache = cache or self.cache
        qsl = torch.arange(self.batch_size + 1, dtype=torch.int32, device=q.device) * q_len
        plan = planner.plan_attention(self.batch_size, cache.num_kv_heads, q.shape[1] // cache.num_kv_heads, q_len,
                                      self.seq_len, cache.head_dim, heads_per_block=heads_per_block if q_len == 1 else None,
                                      token_major=cache.token_major, fused=fused, device=q.device,
                                      query_lens=[q_len] * self.batch_size if dense else None,
                                      sliding_window=features.get("sliding_window"))
        kg = self.kg
        if dense:
            engine = DensePrefill(q.device, q.shape[1], cache.num_kv_heads, cache.head_dim, q.dtype, q.shape[0])
            plan = engine.plan(plan, [q_len] * self.batch_size, [self.seq_len] * self.batch_size, softmax_scale=self.scale,
                               sliding_window=features.get("sliding_window"),
                               logits_soft_cap=features.get("logits_soft_cap"))
            kg = float(self.kg)
        wsp = plan.allocate_workspace(q.device)
        out = torch.empty_like(q)
        host = dict(seq_lens_cpu=self.seq.cpu(), query_start_loc_cpu=qsl.cpu())  # as the engines pass them
        call = lambda: ops.paged_attention(q, cache, self.table, self.seq, qsl, kg, self.vg, self.scale,
                                           max_query_len=q_len, out=out, plan=plan, workspace=wsp, **host, **features)
        call()
        return call, out, plan, qsl

    def reference(self, q: torch.Tensor, qsl: torch.Tensor, nreq: int, rotated: bool = False,
                  sliding_window=None, logits_soft_cap=None, sinks=None) -> torch.Tensor:
        """fp64 attention of q (rows of the first nreq requests, starting at qsl) on the cache's
        bytes; rotated: q rotated in and the output back, as a Hadamard-mode cache is read."""
        h = fmt.hadamard(q.shape[-1], q.device, torch.float64) if rotated else None
        rot = (lambda x: x @ h) if rotated else (lambda x: x)
        return rot(reference.paged_attention_ref(rot(q.double()), self.cache, self.table[:nreq], self.seq[:nreq], qsl,
                                                 self.kg, self.vg, self.scale, sliding_window, logits_soft_cap, sinks,
                                                 dtype=torch.float64))

    def flashinfer_paging(self):
        """(indptr, indices, last page lengths) of FlashInfer's paged-KV API."""
        B, npp = self.table.shape
        dev = self.table.device
        return (torch.arange(B + 1, dtype=torch.int32, device=dev) * npp, self.table.flatten(),
                torch.full((B,), self.seq_len - (npp - 1) * self.cache.page_size, dtype=torch.int32, device=dev))


def uniform_batch(B: int, L: int, page_size: int, args, device, gen) -> UniformBatch:
    npp = math.ceil(L / page_size)
    pages = B * npp + 1
    cache = random_nvfp4_cache(pages, page_size, args.kv_heads, args.head_dim, args.layout, device, gen)
    table = (torch.randperm(pages - 1, device=device, generator=gen)[: B * npp] + 1).to(torch.int32).view(B, npp)
    return UniformBatch(cache, table, torch.full((B,), L, dtype=torch.int32, device=device), L,
                        torch.tensor(0.02, device=device), torch.tensor(0.03, device=device), 1 / math.sqrt(args.head_dim))


def _timed(t: Timing, nbytes: float) -> dict:
    """A row's times (us: isolated, us_b2b: back to back) and the bandwidths they give for nbytes."""
    tbps = lambda us: nbytes / (us * 1e-6) / 1e12
    return dict(us=t.isolated, tbps=tbps(t.isolated), us_b2b=t.back_to_back, tbps_b2b=tbps(t.back_to_back))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def bench_case(B, L, page_size, args, device, gen, fi, ws) -> list[dict]:
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    batch = uniform_batch(B, L, page_size, args, device, gen)
    kv_bytes = B * L * hkv * 2 * fmt.bytes_per_token_head(d)
    variants = ([(1, KVMode())] + ([(args.spec_q_len, KVMode())] if args.spec_q_len > 1 else [])
                + [(1, KVMode.from_name(name)) for name in args.modes.split(",") if name != "plain"])
    rows = []
    for q_len, mode in variants:
        q = torch.randn(B * q_len, hq, d, dtype=torch.bfloat16, device=device)
        # same bytes; a rotating mode adds q H and out H
        fused = {"auto": None, "on": True, "off": False}[getattr(args, "fused", "auto")]
        if fused and not capabilities.fused_allowed(d, hq // hkv, q_len, getattr(args, "heads_per_block", None) or 1):
            fused = False
        call, out, plan, qsl = batch.attention(q, q_len, dataclasses.replace(batch.cache, mode=mode),
                                               getattr(args, "heads_per_block", None), fused)
        nref = min(B, 2)
        ref = batch.reference(q[: nref * q_len], qsl[: nref + 1], nref, rotated=mode.rotation == "hadamard")
        t = time_graph(call, args.iters)
        row = dict(B=B, L=L, page_size=page_size, impl="nvfp4-backend", kv="nvfp4", q_len=q_len, **_timed(t, kv_bytes),
                   rel_err=_rel_err(out[: nref * q_len], ref), splits=plan.num_splits,
                   heads_per_block=plan.heads_per_block, fused=plan.fused)
        if mode != KVMode():
            row["mode"] = mode.name
        rows.append(row)
    if fi is not None:
        rows += bench_flashinfer(fi, batch, args, device, ws)
    del batch
    torch.cuda.empty_cache()
    return rows


def flashinfer_kv(kv: str, cache: PagedKVCache, layout: str, kg, vg, device):
    """(K, V, kv dtype, run() kwargs, bytes per element) in FlashInfer's paged layout: [pages, page,
    heads, D] (NHD) or [pages, heads, page, D] (HND).  NVFP4 is our cache's own bytes (its views are
    [pages, page, heads, ·] in both layouts, so HND is handed over transposed); BF16 / FP8 are
    random caches of the same shape."""
    ps, hkv, d = cache.page_size, cache.num_kv_heads, cache.head_dim
    view = (lambda t: t.transpose(1, 2)) if layout == "HND" else (lambda t: t)
    if kv == "nvfp4":
        return (view(cache.k_data), view(cache.v_data), torch.uint8,
                dict(k_scale=float(kg), v_scale=float(vg),
                     kv_cache_sf=(view(cache.k_block_scales).view(torch.float8_e4m3fn),
                                  view(cache.v_block_scales).view(torch.float8_e4m3fn))),
                fmt.bytes_per_token_head(d) / d)
    dt = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    shape = (cache.num_pages, ps, hkv, d) if layout == "NHD" else (cache.num_pages, hkv, ps, d)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dt)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dt)
    return k, v, dt, (dict(k_scale=0.02, v_scale=0.03) if kv == "fp8" else {}), (2.0 if kv == "bf16" else 1.0)


def bench_flashinfer(fi, batch: UniformBatch, args, device, ws) -> list[dict]:
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    B, L, ps = batch.batch_size, batch.seq_len, batch.cache.page_size
    q = torch.randn(B, hq, d, dtype=torch.bfloat16, device=device)
    elems = B * L * hkv * d * 2
    rows = []
    for kv in ("bf16", "fp8", "nvfp4"):
        try:
            kc, vc, dt, kw, bpe = flashinfer_kv(kv, batch.cache, args.layout, batch.kg, batch.vg, device)
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, args.layout, use_tensor_cores=True)
            w.plan(*batch.flashinfer_paging(), hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=dt)
            out = torch.empty_like(q)
            t = time_graph(lambda: w.run(q, (kc, vc), out=out, **kw), args.iters)
            row = dict(B=B, L=L, page_size=ps, impl="flashinfer-fa2", kv=kv, q_len=1, **_timed(t, elems * bpe))
            if kv == "nvfp4":  # on our cache's bytes: checked like ours
                nref = min(B, 2)
                qsl = torch.arange(nref + 1, dtype=torch.int32, device=device)
                row["rel_err"] = _rel_err(out[:nref], batch.reference(q[:nref], qsl, nref))
            rows.append(row)
            del kc, vc
        except Exception as exc:
            print(f"  flashinfer {kv} B={B} L={L} ps={ps}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
    return rows


def _meta(args, device, fi, **extra) -> dict:
    """What a results file records about the run: GPU, date, versions, the attention shape."""
    return dict(gpu=torch.cuda.get_device_name(device), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                flashinfer=getattr(fi, "__version__", None), **extra, q_heads=args.q_heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim, layout=args.layout)


def bench_write(device, gen, iters, mode: KVMode = KVMode()) -> dict:
    tokens, hkv, d = 16384, 8, 128
    cache = PagedKVCache.allocate(tokens // 16 + 1, 16, hkv, d, "HND", device, mode)
    k = torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    slots = torch.randperm(tokens, device=device) + 16
    kg = torch.tensor(0.01, device=device)
    t = time_graph(lambda: ops.write_kv(k, v, slots, cache, kg, kg), iters)
    moved = 2 * tokens * hkv * d * 2 + 2 * tokens * hkv * fmt.bytes_per_token_head(d)
    return dict(impl="nvfp4-backend write_kv", mode=mode.name, tokens=tokens, **_timed(t, moved))


def run(args) -> int:
    if args.zoo or args.zoo_rows:
        from .bench_zoo import zoo_args_error
        if error := zoo_args_error(args):
            print(f"nvfp4-backend bench: {error}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("nvfp4-backend bench needs a CUDA GPU (none is visible to torch here).", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if args.blocks_per_sm:
        planner.SPLIT_BLOCKS_PER_SM = args.blocks_per_sm
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    grid = DEFAULT_GRID if not args.grid else [tuple(int(x) for x in c.split("x")) for c in args.grid.split(",")]
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    if args.step:
        from .bench_step import run_step
        return run_step(args, device)
    fi = None if args.no_peers else load_flashinfer()
    ws = torch.zeros(512 << 20, dtype=torch.uint8, device=device) if fi is not None else None
    if args.prefill:
        from .bench_prefill import run_prefill
        return run_prefill(args, device, gen, fi, ws)
    if args.zoo:
        from .bench_zoo import run_zoo
        return run_zoo(args, device, gen, fi, ws)
    copy = copy_bandwidth(device)
    meta = _meta(args, device, fi, copy_tbps=copy)
    print(f"{meta['gpu']}: copy bandwidth {copy:.2f} TB/s (read + write)", flush=True)
    rows = []
    for ps in page_sizes:
        for B, L in grid:
            rows += bench_case(B, L, ps, args, device, gen, fi, ws)
            print(format_rows([r for r in rows if r["B"] == B and r["L"] == L and r["page_size"] == ps]), flush=True)
    writes = [bench_write(device, gen, args.iters, KVMode.from_name(name)) for name in args.modes.split(",")]
    for w in writes:
        print(f"write_kv 16K tokens, mode {w['mode']}: {w['us']:.1f} us, {w['tbps']:.2f} TB/s "
              f"({w['tbps'] / copy:.0%} of copy); back to back {w['us_b2b']:.1f} us, {w['tbps_b2b']:.2f} TB/s "
              f"({w['tbps_b2b'] / copy:.0%})")
    Path(args.out).write_text(json.dumps(dict(meta=meta, decode=rows, write=writes), indent=1))
    plain = [r for r in rows if r.get("mode", "plain") == "plain"]
    plot(plain, meta, args.plot)
    print("\nisolated replays (launch latency included, as in the issue's peer table):\n" + summary_table(plain, copy))
    print("\nback-to-back replays (L2 evicted between them: the GPU time of a step):\n"
          + summary_table(plain, copy, "us_b2b", "tbps_b2b"))
    if len(plain) < len(rows):
        print("\n" + mode_table(rows))
    return 0
