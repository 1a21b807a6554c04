"""``nvfp4-backend bench --step``: one engine step of one layer, as vLLM's scheduler shapes it.

A step writes its new tokens' K/V into the cache (quantize-on-write) and runs attention for every
request in it: decodes (one new token over a long context) next to prefill chunks (many new tokens,
possibly over a cached prefix).  Ours is ``ops.write_kv`` + one ``ops.paged_attention`` over the
whole ragged batch (the decode kernel for the decodes, the prefill kernel for the chunks).  FlashInfer
does the same step with BF16, FP8 and NVFP4 caches: the write (its NVFP4 append by slot; BF16 and
FP8 by a scatter, as vLLM writes them), then its paged decode wrapper for the decodes and its paged
prefill wrapper for the chunks (vLLM's FlashInfer backend splits the batch the same way).  Every
step is captured in a CUDA graph and timed like the decode benchmark (bench.time_graph: isolated and
back-to-back replays), in one process.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import dense_prefill, ops, planner, reference
from ..dense_prefill import DensePrefill
from .bench import _meta, _rel_err, load_flashinfer, random_nvfp4_cache
from .timing import time_graph


@dataclass(frozen=True)
class Mix:
    """A step: groups of (requests, cached tokens before the step, new tokens each), and the model."""
    name: str
    groups: tuple[tuple[int, int, int], ...]
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    window: int | None = None
    sinks: bool = False


MIXES = (
    Mix("64 decodes at 8K + a 2K chunk over 12K", ((64, 8192, 1), (1, 12288, 2048))),
    Mix("256 decodes at 2K + four 512 chunks", ((256, 2048, 1), (4, 0, 512))),
    Mix("8 chunks of 512 over 2K", ((8, 2048, 512),)),
    Mix("one 16K prefill", ((1, 0, 16384),)),
    Mix("1 decode at 128K + an 8K chunk", ((1, 131072, 1), (1, 0, 8192))),
    Mix("gpt-oss: 32 decodes at 8K + a 2K chunk, D 64, 64/8 heads, window 128, sinks",
        ((32, 8192, 1), (1, 0, 2048)), q_heads=64, kv_heads=8, head_dim=64, window=128, sinks=True),
)
PAGE_SIZE = 16


@dataclass
class Step:
    """One mix laid out on pages in random order: per request its cached and new tokens."""
    mix: Mix
    ctx: list[int]
    new: list[int]
    table: torch.Tensor      # [B, pages] int32
    seq_lens: torch.Tensor   # [B] int32: cached + new
    qsl: torch.Tensor        # [B + 1] int32: the new tokens' rows
    slots: torch.Tensor      # [new tokens] int64: where they are written
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_pages: int

    @property
    def decodes(self) -> list[int]:
        return [b for b, n in enumerate(self.new) if n == 1]

    @property
    def chunks(self) -> list[int]:
        return [b for b, n in enumerate(self.new) if n > 1]

    def paging(self, requests: list[int]):
        """FlashInfer's (qo indptr, kv indptr, kv indices, last page lengths) for some requests."""
        dev = self.table.device
        lens = [self.ctx[b] + self.new[b] for b in requests]
        pages = [math.ceil(n / PAGE_SIZE) for n in lens]
        indices = torch.cat([self.table[b, :p] for b, p in zip(requests, pages)])
        cum = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0).tolist()), dtype=torch.int32, device=dev)
        last = torch.tensor([n - (p - 1) * PAGE_SIZE for n, p in zip(lens, pages)], dtype=torch.int32, device=dev)
        return cum([self.new[b] for b in requests]), cum(pages), indices, last


def make_step(mix: Mix, device, gen) -> Step:
    ctx = [c for n, c, _ in mix.groups for _ in range(n)]
    new = [q for n, _, q in mix.groups for _ in range(n)]
    pages = [math.ceil((c + q) / PAGE_SIZE) for c, q in zip(ctx, new)]
    num_pages = sum(pages) + 1
    perm = (torch.randperm(num_pages - 1, generator=gen, device=device) + 1).to(torch.int32)
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32, device=device)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        at += p
    slots = torch.cat([table[b, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE
                       for b, (c, q) in enumerate(zip(ctx, new)) for pos in [torch.arange(c, c + q, device=device)]])
    qsl = torch.tensor([0] + list(torch.tensor(new).cumsum(0).tolist()), dtype=torch.int32, device=device)
    tokens = sum(new)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
    return Step(mix, ctx, new, table, torch.tensor([c + q for c, q in zip(ctx, new)], dtype=torch.int32, device=device),
                qsl, slots, rand(tokens, mix.q_heads, mix.head_dim), rand(tokens, mix.kv_heads, mix.head_dim),
                rand(tokens, mix.kv_heads, mix.head_dim), num_pages)


def ours(step: Step, device, gen, dense: bool = False):
    """(the step's call, a check of the last chunk's rows against the fp64 reference, whether the dense
    path serves the chunks); dense: planned for it (``dense_prefill``, the K global scale on the host),
    which leaves a step below ``DensePrefill.min_flops`` to the prefill kernel."""
    mix = step.mix
    cache = random_nvfp4_cache(step.num_pages, PAGE_SIZE, mix.kv_heads, mix.head_dim, "HND", device, gen)
    kg, vg = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
    sinks = torch.randn(mix.q_heads, generator=gen, device=device) if mix.sinks else None
    scale = 1 / math.sqrt(mix.head_dim)
    max_q = max(step.new)
    plan = planner.plan_attention(len(step.new), mix.kv_heads, mix.q_heads // mix.kv_heads, max_q, int(step.seq_lens.max()),
                              mix.head_dim, planner.num_sms(device), device=device, query_lens=step.new,
                              sliding_window=mix.window)
    kg_call = kg
    if dense:
        engine = DensePrefill(device, mix.q_heads, mix.kv_heads, mix.head_dim, step.q.dtype, step.q.shape[0])
        plan = engine.plan(plan, step.new, step.seq_lens.tolist(), softmax_scale=scale, sliding_window=mix.window)
        kg_call = float(kg)
    ws = plan.allocate_workspace(device)
    out = torch.empty_like(step.q)
    host = dict(seq_lens_cpu=step.seq_lens.cpu(), query_start_loc_cpu=step.qsl.cpu())

    def call():
        ops.write_kv(step.k, step.v, step.slots, cache, kg, vg)
        ops.paged_attention(step.q, cache, step.table, step.seq_lens, step.qsl, kg_call, vg, scale, max_query_len=max_q,
                            sliding_window=mix.window, sinks=sinks, out=out, plan=plan, workspace=ws, **host)

    def check() -> float:
        b = len(step.new) - 1
        rows = min(step.new[b], 64)
        first = int(step.qsl[b + 1]) - rows
        qsl = torch.tensor([0, rows], dtype=torch.int32, device=device)
        ref = reference.paged_attention_ref(step.q[first:first + rows], cache, step.table[b:b + 1], step.seq_lens[b:b + 1],
                                            qsl, kg, vg, scale, mix.window, None, sinks, dtype=torch.float64)
        return _rel_err(out[first:first + rows], ref)

    return call, check, plan.prefill is not None


def flashinfer_step(fi, step: Step, kv: str, device, ws):
    """FlashInfer's same step with a ``kv`` (bf16, fp8, nvfp4) cache of its own layout (HND): its named
    pieces (append, decode, prefill), called in order.  NVFP4 is written by FlashInfer's quantizing
    append by slot; BF16 and FP8 by a scatter (below)."""
    mix = step.mix
    hq, hkv, d = mix.q_heads, mix.kv_heads, mix.head_dim
    shape = (step.num_pages, hkv, PAGE_SIZE, d)
    if kv == "nvfp4":
        kc, vc = (torch.randint(0, 256, shape[:3] + (d // 2,), dtype=torch.uint8, device=device) for _ in range(2))
        ks, vs = (torch.randint(0x28, 0x48, shape[:3] + (d // 16,), dtype=torch.uint8, device=device)
                  .view(torch.float8_e4m3fn) for _ in range(2))
        dt, kw = torch.uint8, dict(k_scale=0.02, v_scale=0.03, kv_cache_sf=(ks, vs))
        kg, vg = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
        append = lambda: fi.page.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
            step.k, step.v, step.slots, (kc, vc), (ks, vs), kg, vg, "HND")
    else:
        # BF16 / FP8 pages written by slot with a torch scatter, as vLLM writes them (its own
        # reshape_and_cache, not FlashInfer's append): FlashInfer's append_paged_kv_cache faults with an
        # illegal address on the larger mixes (33729 pages; its inputs checked in bounds on the CPU)
        dt = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
        kc, vc = (torch.randn(shape, device=device, dtype=torch.bfloat16).to(dt) for _ in range(2))
        kw = dict(k_scale=0.02, v_scale=0.03) if kv == "fp8" else {}
        page, slot = step.slots // PAGE_SIZE, step.slots % PAGE_SIZE
        bits = torch.int16 if kv == "bf16" else torch.uint8  # a scatter of the bits (any dtype indexes)
        k_rows, v_rows = (c.transpose(1, 2).view(bits) for c in (kc, vc))  # [pages, page, heads, D] views

        def append():
            k_rows[page, slot] = step.k.to(dt).view(bits)
            v_rows[page, slot] = step.v.to(dt).view(bits)
    extra = dict(window_left=mix.window - 1 if mix.window else -1, logits_soft_cap=None, sm_scale=1 / math.sqrt(d))
    sinks = dict(sinks=torch.randn(hq, device=device)) if mix.sinks else {}
    pieces = [("append", append)]
    out = torch.empty_like(step.q)
    for requests, decode in ((step.decodes, True), (step.chunks, False)):
        if not requests:
            continue
        qo_indptr, kv_indptr, indices, last = step.paging(requests)
        rows = torch.cat([torch.arange(int(step.qsl[b]), int(step.qsl[b + 1]), device=device) for b in requests])
        q, o = step.q[rows].contiguous(), out[rows].contiguous()
        if decode:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws[0], "HND", use_tensor_cores=True)
            w.plan(kv_indptr, indices, last, hq, hkv, d, PAGE_SIZE, q_data_type=torch.bfloat16, kv_data_type=dt,
                   **extra)
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws[1], "HND")
            w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, PAGE_SIZE, causal=True,
                   q_data_type=torch.bfloat16, kv_data_type=dt, **extra)
        pieces.append(("decode" if decode else "prefill", lambda w=w, q=q, o=o: w.run(q, (kc, vc), out=o, **kw, **sinks)))
    return pieces


def first_run_names_the_failing_piece(pieces) -> None:
    """Each piece once, synchronized, so an asynchronous fault (it ends the process's CUDA context) is
    reported with the piece that caused it before the step is timed."""
    for name, piece in pieces:
        try:
            piece()
            torch.cuda.synchronize()
        except Exception as exc:
            raise RuntimeError(f"FlashInfer's {name} failed: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _mix_generator(device, index: int) -> torch.Generator:
    """A mix's own seed: ours and the peers lay out the same step."""
    gen = torch.Generator(device=device)
    gen.manual_seed(index)
    return gen


def run_step(args, device) -> int:
    fi = None if args.no_peers else load_flashinfer()
    ws = [torch.zeros(256 << 20, dtype=torch.uint8, device=device) for _ in range(2)] if fi is not None else None
    chosen = list(enumerate(MIXES)) if args.step == "all" else [(int(i), MIXES[int(i)]) for i in args.step.split(",")]
    meta = _meta(args, device, fi, mixes=[m.name for m in MIXES], page_size=PAGE_SIZE)
    rows = []
    save = lambda: Path(args.out).write_text(json.dumps(dict(meta=meta, step=rows), indent=1))
    # ours for every mix first: a peer's fault ends the process's CUDA context, and must not take our rows with it
    for index, mix in chosen:
        gen = _mix_generator(device, index)
        step = make_step(mix, device, gen)
        call, check, _ = ours(step, device, gen)
        t = time_graph(call, args.iters)
        rows.append(dict(mix=mix.name, impl="nvfp4-backend", kv="nvfp4", us=t.isolated, us_b2b=t.back_to_back,
                         rel_err=check(), graph=True))
        if dense_prefill.unavailable_reason(device) is None and step.chunks:
            call, check, planned = ours(step, device, gen, dense=True)  # outside graphs, as engines run prefill
            t = time_graph(call, args.iters, capture=False)
            rows.append(dict(mix=mix.name, impl="nvfp4-backend-dense", kv="nvfp4", us=t.isolated,
                             us_b2b=t.back_to_back, rel_err=check(), graph=False, dense_planned=planned))
        save()
        del step, call, check
        torch.cuda.empty_cache()
    for index, mix in chosen if fi is not None else ():
        step = make_step(mix, device, _mix_generator(device, index))
        for kv in args.peer_kv.split(","):
            try:
                pieces = flashinfer_step(fi, step, kv, device, ws)
                first_run_names_the_failing_piece(pieces)
                t = time_graph(lambda pieces=pieces: [piece() for _, piece in pieces], args.iters)
                rows.append(dict(mix=mix.name, impl="flashinfer", kv=kv, us=t.isolated, us_b2b=t.back_to_back))
            except Exception as exc:
                print(f"  flashinfer {kv} [{mix.name}]: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
                if "illegal" in str(exc) or "unspecified launch failure" in str(exc):
                    print("  the CUDA context is lost: no further peer is measured", file=sys.stderr)
                    save()
                    print("\n" + step_table(rows))
                    return 1
        save()
        print(step_table([r for r in rows if r["mix"] == mix.name]), flush=True)
        del step
        torch.cuda.empty_cache()
    print("\n" + step_table(rows))
    return 0


def step_table(rows) -> str:
    """Per mix: our step time and FlashInfer's, back to back (isolated in brackets), and the ratios."""
    lines = [f"{'mix':<60s} {'ours us':>16s} {'ours dense':>16s} {'fi-bf16':>16s} {'fi-fp8':>16s} {'fi-nvfp4':>16s} "
             f"{'/bf16':>6s} {'err':>8s}"]
    for name in dict.fromkeys(r["mix"] for r in rows):
        sel = {(r["impl"], r["kv"]): r for r in rows if r["mix"] == name}
        # a dense row the planner left to the prefill kernel (DensePrefill.min_flops), run eagerly: "k"
        cell = lambda r: (f"{r['us_b2b']:7.1f} ({r['us']:6.1f})" + ("k" if r.get("dense_planned") is False else "")
                          ).rjust(16) if r else f"{'-':>16s}"
        mine, bf16 = sel[("nvfp4-backend", "nvfp4")], sel.get(("flashinfer", "bf16"))
        dense = sel.get(("nvfp4-backend-dense", "nvfp4"))
        best = min([mine] + ([dense] if dense else []), key=lambda r: r["us_b2b"])
        ratio = f"{best['us_b2b'] / bf16['us_b2b']:6.2f}" if bf16 else f"{'-':>6s}"
        lines.append(f"{name[:60]:<60s} {cell(mine)} {cell(dense)} {cell(bf16)} {cell(sel.get(('flashinfer', 'fp8')))} "
                     f"{cell(sel.get(('flashinfer', 'nvfp4')))} {ratio} {best['rel_err']:8.1e}")
    return "\n".join(lines)
