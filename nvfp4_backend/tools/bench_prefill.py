"""``nvfp4-backend bench --prefill``: prefill and chunked prefill against FlashInfer's paged prefill."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .. import capabilities, dense_prefill
from .bench import _meta, _rel_err, flashinfer_kv, uniform_batch
from .timing import time_graph


def prefill_features(spec: str, q_heads: int, device) -> dict:
    """A --prefill case's features: "w4096+sinks", "cap50" -> paged_attention's keyword arguments."""
    features = {}
    for part in filter(None, spec.split("+")):
        if part.startswith("w"):
            features["sliding_window"] = int(part[1:])
        elif part.startswith("cap"):
            features["logits_soft_cap"] = float(part[3:])
        elif part == "sinks":
            features["sinks"] = torch.randn(q_heads, device=device)
        else:
            raise ValueError(f"unknown prefill feature {part!r} (w<W>, cap<C>, sinks)")
    return features


def bench_prefill(B, ctx, new, page_size, args, device, gen, fi, ws, features: str = "") -> list[dict]:
    """An extend of ``new`` tokens per request over ``ctx`` cached ones (causal), this project's
    path (the op picks the decode or the prefill kernel) vs FlashInfer's paged prefill,
    both timed eagerly (launch costs included, as an engine's prefill pays them)."""
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    batch = uniform_batch(B, ctx + new, page_size, args, device, gen)
    q = torch.randn(B * new, hq, d, dtype=torch.bfloat16, device=device)
    flops = 4 * B * hq * d * (new * ctx + new * (new + 1) / 2)  # QK^T and PV over the causal triangle
    feats = prefill_features(features, hq, device)
    call, out, plan, qsl = batch.attention(q, new, **feats)
    n = min(new, 128)  # the fp64 reference on the last n rows of request 0
    ref = batch.reference(q[new - n:new], torch.tensor([0, n], dtype=torch.int32, device=device), 1, **feats)
    base = dict(B=B, ctx=ctx, new=new, features=features, page_size=page_size, impl="nvfp4-backend", kv="nvfp4")
    # eager (launch and Python costs included, as an engine running prefill attention outside its
    # graphs pays them) and graph replays (back to back: the GPU time), for every implementation
    t = time_graph(call, args.iters, capture=False, back_to_back=False).isolated
    t_graph = time_graph(call, args.iters).back_to_back
    path = "decode kernel" if capabilities.decode_supports(hq // hkv, new, d) else "prefill kernel"
    rows = [dict(base, path=path, us=t, us_graph=t_graph, tflops=flops / (t * 1e-6) / 1e12,
                 rel_err=_rel_err(out[new - n:new], ref))]
    if dense_prefill.unavailable_reason(device) is None and path == "prefill kernel":
        # the dense path runs outside graphs (its plans are FlashInfer's): eager, isolated and back to back
        call, out, plan, _ = batch.attention(q, new, dense=True, **feats)
        t_dense = time_graph(call, args.iters, capture=False)
        rows.append(dict(base, path="dense" if plan.prefill is not None else "prefill kernel (dense not planned)",
                         us=t_dense.isolated, us_graph=t_dense.back_to_back,
                         tflops=flops / (t_dense.isolated * 1e-6) / 1e12, rel_err=_rel_err(out[new - n:new], ref)))
    if fi is not None:
        for kv in [kv for kv in args.peer_kv.split(",") if kv != "fp8"]:
            try:
                kc, vc, dt, kw, _ = flashinfer_kv(kv, batch.cache, args.layout, batch.kg, batch.vg, device)
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, args.layout)
                w.plan(qsl, *batch.flashinfer_paging(), hq, hkv, d, page_size, causal=True,
                       q_data_type=torch.bfloat16, kv_data_type=dt,
                       window_left=feats.get("sliding_window", 0) - 1, logits_soft_cap=feats.get("logits_soft_cap"))
                fo = torch.empty_like(q)
                sinks = {"sinks": feats["sinks"]} if "sinks" in feats else {}
                run = lambda: w.run(q, (kc, vc), out=fo, **kw, **sinks)
                tf = time_graph(run, args.iters, capture=False, back_to_back=False).isolated
                tf_graph = time_graph(run, args.iters).back_to_back
                row = dict(B=B, ctx=ctx, new=new, features=features, page_size=page_size, impl="flashinfer-fa2", kv=kv,
                           us=tf, us_graph=tf_graph,
                           tflops=flops / (tf * 1e-6) / 1e12)
                if kv == "nvfp4":
                    row["rel_err"] = _rel_err(fo[new - n:new], ref)
                rows.append(row)
            except Exception as exc:
                print(f"  flashinfer prefill {kv} B={B} C={ctx} N={new}: {type(exc).__name__}: {str(exc)[:200]}",
                      file=sys.stderr)
    del batch
    torch.cuda.empty_cache()
    return rows


def run_prefill(args, device, gen, fi, ws) -> int:
    rows = []
    page_size = int(args.page_sizes.split(",")[0])
    for case in args.prefill.split(","):
        shape, _, features = case.partition(":")
        B, ctx, new = (int(x) for x in shape.split("x"))
        got = bench_prefill(B, ctx, new, page_size, args, device, gen, fi, ws, features)
        rows += got
        for r in got:
            # us: one isolated eager call; b2b (us_graph in the JSON): back to back, graph replays except for
            # the dense path, which runs outside graphs and is timed as eager calls back to back
            print(f"B={B:3d} C={ctx:6d} N={new:5d} {features:>12s} {r['impl']:>14s} {r['kv']:5s} {r['us']:9.1f} us "
                  f"(b2b {r['us_graph']:9.1f}) "
                  f"{r['tflops']:6.1f} TFLOP/s" + (f" err={r['rel_err']:.1e}" if "rel_err" in r else "")
                  + (f" [{r['path']}]" if "path" in r else ""),
                  flush=True)
    Path(args.out).write_text(json.dumps(dict(meta=_meta(args, device, fi, page_size=page_size), prefill=rows),
                                         indent=1))
    return 0
