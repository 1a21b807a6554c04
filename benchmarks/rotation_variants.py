"""The K/V transforms the rotation study compares (benchmarks/rotation_study.py): rotations and
smoothing, built per layer into named variants."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nvfp4_backend import format as fmt


# ============================================================================ transforms
@dataclass
class Transform:
    """x -> (x / s) @ m; inverse y -> (y @ m^T) * s.  s: [Hkv, 1, D] or None; m: [D, D] orthogonal or None."""
    s: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.s is not None:
            x = x / self.s
        if self.m is not None:
            x = x @ self.m
        return x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        if self.m is not None:
            y = y @ self.m.T
        if self.s is not None:
            y = y * self.s
        return y


@dataclass
class Variant:
    name: str
    description: str
    quant: bool = True
    rule: str = "6"
    k: list = field(default_factory=list)   # per layer: Transform | None
    v: list = field(default_factory=list)
    group: str = ""


def random_signs(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).float()


def random_orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r))).float()  # Haar-distributed


def smoothing(amax: torch.Tensor, alpha: float, pair_tied: bool = False) -> torch.Tensor:
    """amax [Hkv, D] -> s [Hkv, 1, D] = amax^alpha normalised to geometric mean 1 per head.

    pair_tied: the same s on the two channels RoPE rotates together (i, i + D/2, the rotate_half
    convention), so diag(s) commutes with RoPE and the scaling folds into W_q / W_k offline.
    """
    a = amax.double().clamp_min(1e-4)
    if pair_tied:
        h = a.shape[-1] // 2
        m = torch.maximum(a[:, :h], a[:, h:])
        a = torch.cat([m, m], -1)
    s = a ** alpha
    s = s / torch.exp(torch.log(s).mean(-1, keepdim=True))
    return s.float().unsqueeze(1)


# ============================================================================ variants
def build_variants(layers: int, d: int, amax, args) -> list[Variant]:
    H = fmt.hadamard(d)
    none = [None] * layers
    vs = [
        Variant("bf16", "BF16 K/V, no rounding (the baseline)", quant=False, group="baseline"),
        Variant("nvfp4", "NVFP4, global scale 1.0", group="anchor"),
        Variant("nvfp4-6or4", "NVFP4, 6-or-4 block maximum", rule="6or4", group="anchor"),
        Variant("hadamard", "x H (Sylvester-Hadamard)", k=[Transform(m=H)] * layers, v=[Transform(m=H)] * layers,
                group="anchor"),
        Variant("hadamard-6or4", "x H + 6-or-4", rule="6or4", k=[Transform(m=H)] * layers,
                v=[Transform(m=H)] * layers, group="anchor"),
    ]
    for rule in ("6", "6or4"):
        for seed in args.seeds:
            # one sign vector per layer and per K / V, from a fixed seed
            km = [random_signs(d, 100_000 * seed + 2 * i) [:, None] * H for i in range(layers)]
            vm = [random_signs(d, 100_000 * seed + 2 * i + 1)[:, None] * H for i in range(layers)]
            sfx = "-6or4" if rule == "6or4" else ""
            vs.append(Variant(f"randhad{sfx}-s{seed}", f"x diag(r) H, r random +-1 per layer and K/V (seed {seed})"
                              + (" + 6-or-4" if sfx else ""), rule=rule,
                              k=[Transform(m=m) for m in km], v=[Transform(m=m) for m in vm],
                              group=f"randhad{sfx}"))
    for alpha in args.alphas:
        ks = [smoothing(amax[i][0], alpha) for i in range(layers)]
        vsm = [smoothing(amax[i][1], alpha) for i in range(layers)]
        for rot in (False, True):
            for rule in (("6or4", "6") if args.extras else ("6or4",)):
                name = f"smooth-a{alpha:g}" + ("-hadamard" if rot else "") + ("-6or4" if rule == "6or4" else "")
                m = H if rot else None
                vs.append(Variant(name, f"K, V / s (s = amax^{alpha:g}, per layer, kv head, channel; q and out x s)"
                                  + (", then x H" if rot else "") + (" + 6-or-4" if rule == "6or4" else ""),
                                  rule=rule, k=[Transform(s=s, m=m) for s in ks], v=[Transform(s=s, m=m) for s in vsm],
                                  group="smooth"))
    if args.extras:
        for alpha in args.alphas:
            ks = [smoothing(amax[i][0], alpha) for i in range(layers)]
            ks_tied = [smoothing(amax[i][0], alpha, pair_tied=True) for i in range(layers)]
            vsm = [smoothing(amax[i][1], alpha) for i in range(layers)]
            vs.append(Variant(f"smooth-tied-a{alpha:g}-hadamard-6or4",
                              f"as smooth-a{alpha:g}-hadamard-6or4 with K's s tied on RoPE pairs (foldable into W_q/W_k)",
                              rule="6or4", k=[Transform(s=s, m=H) for s in ks_tied],
                              v=[Transform(s=s, m=H) for s in vsm], group="smooth-extra"))
            vs.append(Variant(f"smooth-konly-a{alpha:g}-hadamard-6or4",
                              f"K smoothed (amax^{alpha:g}, untied) then H, V only H; 6-or-4", rule="6or4",
                              k=[Transform(s=s, m=H) for s in ks], v=[Transform(m=H)] * layers, group="smooth-extra"))
        for seed in args.seeds[:1]:
            km = [random_orthogonal(d, 200_000 + 100_000 * seed + 2 * i) for i in range(layers)]
            vm = [random_orthogonal(d, 200_000 + 100_000 * seed + 2 * i + 1) for i in range(layers)]
            vs.append(Variant(f"randorth-6or4-s{seed}", f"x Q, Q Haar-random orthogonal per layer and K/V (seed {seed}) + 6-or-4",
                              rule="6or4", k=[Transform(m=m) for m in km], v=[Transform(m=m) for m in vm],
                              group="extra"))
    for v in vs:
        if not v.k:
            v.k, v.v = none, none
    if args.only:
        keep = set(args.only) | {"bf16"}
        vs = [v for v in vs if v.name in keep]
    return vs
