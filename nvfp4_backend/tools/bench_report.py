"""The benchmark's tables and plot: rows per case, ours against the peers, the KV modes' cost."""
from __future__ import annotations


def format_rows(rows) -> str:
    return "\n".join(f"B={r['B']:4d} L={r['L']:6d} ps={r['page_size']:3d} q={r['q_len']} {r['impl']:>14s} {r['kv']:5s} "
                     f"{r['us']:9.1f} us {r['tbps']:5.2f} TB/s"
                     + (f" (back to back {r['us_b2b']:.1f} us {r['tbps_b2b']:.2f})" if 'us_b2b' in r else "")
                     + (f" err={r['rel_err']:.1e}" if 'rel_err' in r else "")
                     + (f" splits={r['splits']}" if 'splits' in r else "")
                     + (f" heads/block={r['heads_per_block']}" if r.get('heads_per_block', 1) > 1 else "")
                     + (" fused" if r.get("fused") else "")
                     for r in rows)


def summary_table(rows, copy, us: str = "us", tbps: str = "tbps") -> str:
    """Ours against the peers per case, on one of the two timings (the row keys us / tbps)."""
    lines = [f"{'B x L':>12s} {'ps':>3s} {'ours us':>8s} {'TB/s':>5s} {'%copy':>5s} {'q4 us':>7s} "
             f"{'fi-bf16':>8s} {'fi-fp8':>8s} {'fi-nvfp4':>8s} {'x bf16':>6s} {'x nvfp4':>7s}"]
    keys = sorted({(r["B"], r["L"], r["page_size"]) for r in rows}, key=lambda k: (k[2], -k[0] * k[1]))
    for B, L, ps in keys:
        sel = {(r["impl"], r["kv"], r["q_len"]): r for r in rows if (r["B"], r["L"], r["page_size"]) == (B, L, ps)}
        ours = sel[("nvfp4-backend", "nvfp4", 1)]
        spec = next((r for k, r in sel.items() if k[0] == "nvfp4-backend" and k[2] > 1), None)
        peer = {kv: sel.get(("flashinfer-fa2", kv, 1)) for kv in ("bf16", "fp8", "nvfp4")}
        f = lambda r: f"{r[us]:8.1f}" if r else f"{'-':>8s}"
        ratio = lambda r: f"{r[us] / ours[us]:6.2f}" if r else f"{'-':>6s}"
        lines.append(f"{B:>5d}x{L:<6d} {ps:3d} {ours[us]:8.1f} {ours[tbps]:5.2f} {ours[tbps] / copy:5.0%} "
                     f"{(spec[us] if spec else float('nan')):7.1f} {f(peer['bf16'])} {f(peer['fp8'])} {f(peer['nvfp4'])} "
                     f"{ratio(peer['bf16'])} {ratio(peer['nvfp4']):>7s}")
    return "\n".join(lines)


def mode_table(rows) -> str:
    """Decode time of each KV mode against plain NVFP4 on the same cache (q_len 1)."""
    lines = [f"{'B x L':>12s} {'ps':>3s} {'mode':>14s} {'us':>8s} {'vs plain':>8s}"]
    base = {(r["B"], r["L"], r["page_size"]): r["us"] for r in rows
            if r["impl"] == "nvfp4-backend" and r["q_len"] == 1 and r.get("mode", "plain") == "plain"}
    for r in rows:
        if r.get("mode", "plain") != "plain":
            b = base[(r["B"], r["L"], r["page_size"])]
            lines.append(f"{r['B']:>5d}x{r['L']:<6d} {r['page_size']:3d} {r['mode']:>14s} {r['us']:8.1f} "
                         f"{r['us'] / b - 1:+8.1%}")
    return "\n".join(lines)


def plot(rows, meta, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["impl"], r["kv"], r["q_len"], r["page_size"]) for r in rows})
    for impl, kv, ql, ps in series:
        pts = sorted((r["B"] * r["L"], r["us"], r["tbps"]) for r in rows
                     if (r["impl"], r["kv"], r["q_len"], r["page_size"]) == (impl, kv, ql, ps))
        label = f"{impl} {kv}" + (f" q={ql}" if ql > 1 else "") + f" ps={ps}"
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    axes[1].axhline(meta["copy_tbps"], color="gray", linestyle="--", label="copy bandwidth")
    for ax, name in zip(axes, ("time per decode step (us)", "effective bandwidth (TB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the batch (B x L)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{meta['gpu']}, Hq={meta['q_heads']} Hkv={meta['kv_heads']} D={meta['head_dim']} {meta['layout']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
