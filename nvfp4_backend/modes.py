"""KV modes: accuracy options inside the standard NVFP4 bytes (the 6-or-4 block scale, the Hadamard
rotation), and the mode an engine instance is configured with."""
from __future__ import annotations

import os
from dataclasses import dataclass

from . import format as fmt

ROTATIONS = ("none", "hadamard")


@dataclass(frozen=True)
class KVMode:
    """Accuracy options that keep the standard NVFP4 bytes (same size, same kernels' traffic).

    scale_rule: see ``format.SCALE_RULES``.  rotation "hadamard": K and V are stored as k H and v H
    (H = ``format.hadamard(head_dim)``); attention rotates q by H and the output back by H, so no
    extra pass over the cache is made.  The mode travels with the cache so that a cache is never
    read with a mode other than the one it was written with.
    """
    scale_rule: str = "6"
    rotation: str = "none"

    def __post_init__(self) -> None:
        if self.scale_rule not in fmt.SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {fmt.SCALE_RULES}, got {self.scale_rule!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")

    @property
    def name(self) -> str:
        parts = (["hadamard"] if self.rotation == "hadamard" else []) + (["6or4"] if self.scale_rule == "6or4" else [])
        return "-".join(parts) or "plain"

    @classmethod
    def from_name(cls, name: str) -> "KVMode":
        """The inverse of ``name``: "plain", "6or4", "hadamard" or "hadamard-6or4"."""
        modes = {m.name: m for m in (cls(s, r) for r in ROTATIONS for s in fmt.SCALE_RULES)}
        if name not in modes:
            raise ValueError(f"KV mode must be one of {sorted(modes)}, got {name!r}")
        return modes[name]


KV_MODE_ENV = "NVFP4_BACKEND_KV_MODE"
DEFAULT_KV_MODE = "6or4"


def configured_kv_mode() -> KVMode:
    """The mode an engine instance writes and reads its caches with: ``$NVFP4_BACKEND_KV_MODE``, else
    ``DEFAULT_KV_MODE``.  Both plugins read it once per attention layer, when the engine builds it,
    so one engine never mixes modes; a bad value stops the engine with the list of valid ones."""
    name = os.environ.get(KV_MODE_ENV, "").strip() or DEFAULT_KV_MODE
    try:
        return KVMode.from_name(name)
    except ValueError as exc:
        raise ValueError(f"${KV_MODE_ENV}: {exc}") from None
