"""The KV formats the evaluation compares and the paged stores that hold them: a plain dtype (BF16,
FP8, fp32) in a paged tensor, or NVFP4 through ``ops.write_kv`` / ``ops.paged_attention``."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import format as fmt
from .. import ops, reference
from ..layout import PagedKVCache
from ..modes import KVMode

FP8_MAX = 448.0


# ============================================================================ formats
@dataclass(frozen=True)
class KVFormat:
    name: str
    kind: str                   # "dense" (a paged tensor of ``storage``) or "nvfp4" (PagedKVCache + ops)
    storage: torch.dtype | None
    scale: str                  # "one": global/per-tensor scale 1.0; "amax": calibrated from K/V amax
    description: str
    mode: KVMode = KVMode()     # nvfp4 accuracy mode (same bytes): block-maximum rule, rotation

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Cache bytes of one token of one kv head, for K (the same again for V)."""
        if self.kind == "nvfp4":
            return fmt.bytes_per_token_head(head_dim)
        return head_dim * torch.empty((), dtype=self.storage).element_size()


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("fp32", "dense", torch.float32, "one",
             "fp32 K/V and fp32 attention I/O: the model's own numerics (the runner's test oracle)"),
    KVFormat("bf16", "dense", torch.bfloat16, "one", "BF16 K/V (the baseline)"),
    KVFormat("fp8", "dense", torch.float8_e4m3fn, "one",
             "FP8 E4M3 per-tensor, scale 1.0 (the engines' default without calibration)"),
    KVFormat("fp8-amax", "dense", torch.float8_e4m3fn, "amax",
             "FP8 E4M3 per-tensor, per-layer scale = amax / 448 from a calibration text"),
    KVFormat("nvfp4", "nvfp4", None, "one",
             "NVFP4 (E2M1 + E4M3 per 16), global scale 1.0 (the engines' default)"),
    KVFormat("nvfp4-amax", "nvfp4", None, "amax",
             "NVFP4, per-layer global scale = format.calibrate_global_scale(amax) from a calibration text"),
    KVFormat("nvfp4-6or4", "nvfp4", None, "one", "NVFP4, 6-or-4 block maximum, global scale 1.0",
             KVMode(scale_rule="6or4")),
    KVFormat("nvfp4-hadamard", "nvfp4", None, "one", "NVFP4 after a Hadamard rotation of the head dim, scale 1.0",
             KVMode(rotation="hadamard")),
    KVFormat("nvfp4-hadamard-6or4", "nvfp4", None, "one", "NVFP4, Hadamard rotation + 6-or-4, global scale 1.0",
             KVMode(scale_rule="6or4", rotation="hadamard")),
)}


def get_format(name: str) -> KVFormat:
    if name not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {list(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]


def kv_scales_from_amax(kv_format: str, amax: list[tuple[float, float]], headroom: float = 1.0) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) dequant multipliers that map amax * headroom onto the format's max."""
    f = get_format(kv_format)
    if f.kind == "nvfp4":
        return [(fmt.calibrate_global_scale(k, headroom), fmt.calibrate_global_scale(v, headroom)) for k, v in amax]
    if f.storage == torch.float8_e4m3fn:
        return [(k * headroom / FP8_MAX if k > 0 else 1.0, v * headroom / FP8_MAX if v > 0 else 1.0) for k, v in amax]
    return [(1.0, 1.0) for _ in amax]


# ============================================================================ step metadata
@dataclass
class StepMeta:
    """One forward step of a packed batch, in the engines' terms."""
    slot_mapping: torch.Tensor       # [tokens] int64: cache slot of each new token
    block_table: torch.Tensor        # [batch, max_pages] int32
    seq_lens: torch.Tensor           # [batch] int32: cache length after this step's writes
    query_start_loc: torch.Tensor    # [batch + 1] int32
    max_query_len: int
    page_size: int
    _gather: tuple | None = field(default=None, repr=False)

    def gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [batch, max_seq_len], live mask) of every request's cache positions (cached per step)."""
        if self._gather is None:
            max_len = int(self.seq_lens.max())
            pos = torch.arange(max_len, device=self.block_table.device)
            live = pos[None, :] < self.seq_lens[:, None]
            col = (pos // self.page_size).clamp(max=self.block_table.shape[1] - 1)
            pages = self.block_table[:, col].long()
            slots = torch.where(live, pages * self.page_size + pos % self.page_size, torch.zeros_like(pages))
            self._gather = (slots, live)
        return self._gather


# ============================================================================ KV stores
class DenseStore:
    """A paged cache of a plain dtype (bf16, fp8 E4M3 per-tensor, fp32), one tensor per layer and K/V."""

    def __init__(self, kv_format: KVFormat, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, scales: list[tuple[float, float]], device, record_amax: bool = False):
        self.format = kv_format
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=kv_format.storage, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=kv_format.storage, device=device) for _ in range(num_layers)]
        self.scales = scales
        self.amax = [[0.0, 0.0] for _ in range(num_layers)] if record_amax else None

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.format.storage == torch.float8_e4m3fn:
            x = x.float() * (1.0 / scale)
            return torch.where(torch.isnan(x), x, x.clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)  # satfinite
        return x.to(self.format.storage)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        if self.amax is not None:
            self.amax[layer][0] = max(self.amax[layer][0], float(key.float().abs().max()))
            self.amax[layer][1] = max(self.amax[layer][1], float(value.float().abs().max()))
        ks, vs = self.scales[layer]
        self.k[layer][slots] = self._encode(key, ks)
        self.v[layer][slots] = self._encode(value, vs)

    def attend(self, layer: int, q: torch.Tensor, meta: StepMeta, softmax_scale: float, sliding_window=None,
               soft_cap=None, sinks=None) -> torch.Tensor:
        slots, live = meta.gather_index()
        ks, vs = self.scales[layer]
        out = []
        for cache, s in ((self.k[layer], ks), (self.v[layer], vs)):
            x = cache[slots].float()
            if s != 1.0:
                x = x * s
            out.append(torch.where(live[:, :, None, None], x, torch.zeros_like(x)))
        o = reference.attention_ref(q, out[0], out[1], meta.seq_lens, meta.query_start_loc, softmax_scale,
                                    sliding_window, soft_cap, sinks, dtype=torch.float32)
        return o.to(q.dtype)


class NVFP4Store:
    """One ``PagedKVCache`` per layer, written with ``ops.write_kv`` and read with ``ops.paged_attention``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 scales: list[tuple[float, float]], device, layout: str = "NHD", mode: KVMode = KVMode()):
        self.caches = [PagedKVCache.allocate(num_pages, page_size, num_kv_heads, head_dim, layout, device, mode)
                       for _ in range(num_layers)]
        self.kg = [torch.tensor(k, dtype=torch.float32, device=device) for k, _ in scales]
        self.vg = [torch.tensor(v, dtype=torch.float32, device=device) for _, v in scales]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        ops.write_kv(key.contiguous(), value.contiguous(), slots, self.caches[layer], self.kg[layer], self.vg[layer])

    def attend(self, layer: int, q: torch.Tensor, meta: StepMeta, softmax_scale: float, sliding_window=None,
               soft_cap=None, sinks=None) -> torch.Tensor:
        return ops.paged_attention(q.contiguous(), self.caches[layer], meta.block_table, meta.seq_lens,
                                   meta.query_start_loc, self.kg[layer], self.vg[layer], softmax_scale,
                                   max_query_len=meta.max_query_len, sliding_window=sliding_window,
                                   logits_soft_cap=soft_cap, sinks=sinks)
