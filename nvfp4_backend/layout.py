"""One description of a paged NVFP4 cache, whatever the engine's memory layout.

Every layout is four strided uint8 views with the same logical shapes:

    k_data, v_data                 [num_pages, page_size, num_kv_heads, head_dim / 2]
    k_block_scales, v_block_scales [num_pages, page_size, num_kv_heads, head_dim / 16]

so a kernel takes base pointer + (page, token, head) strides for data and for scales, and the
reference indexes the views directly.  The constructors below build those views (no copies) for
NHD and HND pages, vLLM 0.33's inline page and SGLang 0.5.23's token rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import format as fmt
from .modes import KVMode

LAYOUTS = ("NHD", "HND")


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill one gap-free, non-overlapping range (in some dimension order)."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).is_contiguous()


@dataclass(frozen=True)
class PagedKVCache:
    k_data: torch.Tensor
    k_block_scales: torch.Tensor
    v_data: torch.Tensor
    v_block_scales: torch.Tensor
    mode: KVMode = KVMode()
    # the tensors validate() last passed (by identity): every op call validates the cache it is given,
    # and an engine passes the same one each layer and step
    _validated: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, KVMode):
            raise TypeError(f"mode must be a KVMode, got {type(self.mode).__name__}")
        if self.mode.rotation == "hadamard":
            fmt.hadamard(self.head_dim)  # raises unless the head dim is a power of two
        self.validate()

    # ------------------------------------------------------------------ geometry
    @property
    def num_pages(self) -> int:
        return self.k_data.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_data.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_data.shape[3] * fmt.FP4_PER_BYTE

    @property
    def token_major(self) -> bool:
        """Whether a token's kv heads lie side by side in memory (NHD pages, SGLang's token rows, any
        page of one token), not a head's tokens (HND pages of more than one token)."""
        return self.k_data.stride(2) == self.k_data.shape[3]

    @property
    def device(self) -> torch.device:
        return self.k_data.device

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_data, self.k_block_scales, self.v_data, self.v_block_scales

    def validate(self) -> None:
        """Raises unless the four views have the shapes, dtype, strides and device a cache needs; a
        no-op for the tensors it last passed (a view resized in place is not seen again)."""
        checked = tuple(map(id, self.tensors()))
        if checked == self._validated:
            return
        names = ("k_data", "k_block_scales", "v_data", "v_block_scales")
        for name, t in zip(names, self.tensors()):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.uint8:
                raise TypeError(f"{name} must be uint8 (raw bytes), got {t.dtype}")
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [num_pages, page_size, num_kv_heads, bytes], got {tuple(t.shape)}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
            if t.device != self.k_data.device:
                raise ValueError(f"{name} is on {t.device} but k_data is on {self.k_data.device}")
        fmt.check_head_dim(self.head_dim, "k_data.shape[-1] * 2")
        d = self.head_dim
        want_data = (self.num_pages, self.page_size, self.num_kv_heads, fmt.data_bytes(d))
        want_sf = want_data[:3] + (fmt.scale_bytes(d),)
        for name, t, want in zip(names, self.tensors(), (want_data, want_sf, want_data, want_sf)):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")
        object.__setattr__(self, "_validated", checked)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 layout: str = "NHD", device: torch.device | str = "cpu", mode: KVMode = KVMode()) -> "PagedKVCache":
        """Four zeroed tensors in NHD ([pages, page, heads, bytes]) or HND ([pages, heads, page, bytes])."""
        fmt.check_head_dim(head_dim)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

        def make(nbytes: int) -> torch.Tensor:
            if layout == "NHD":
                return torch.zeros(num_pages, page_size, num_kv_heads, nbytes, dtype=torch.uint8, device=device)
            return torch.zeros(num_pages, num_kv_heads, page_size, nbytes, dtype=torch.uint8,
                               device=device).transpose(1, 2)

        return cls(make(fmt.data_bytes(head_dim)), make(fmt.scale_bytes(head_dim)),
                   make(fmt.data_bytes(head_dim)), make(fmt.scale_bytes(head_dim)), mode)

    @classmethod
    def from_inline_pages(cls, pages: torch.Tensor, page_size: int, num_kv_heads: int, head_dim: int,
                          head_major: bool, mode: KVMode = KVMode()) -> "PagedKVCache":
        """vLLM's inline NVFP4 page: ``[K data | K scales | V data | V scales]`` in each page.

        ``pages`` is any uint8 tensor whose dim 0 indexes pages and whose page bytes are dense in
        some dimension order (vLLM hands ``[num_blocks, 2 * num_kv_heads, block_size, D/2 + D/16]``,
        permuted for its NHD layouts); the byte order within the page is what counts.  Within a side,
        data is ``[heads, page_size, D/2]`` (head_major, HND) or ``[page_size, heads, D/2]`` (NHD),
        followed by the scales in the same order.
        """
        fmt.check_head_dim(head_dim)
        if pages.dtype != torch.uint8:
            raise TypeError(f"pages must be uint8, got {pages.dtype}")
        side = page_size * num_kv_heads * fmt.bytes_per_token_head(head_dim)
        page_bytes = pages[0].numel() if pages.shape[0] else 2 * side
        if pages.shape[0] and not _dense(pages[0]):
            raise ValueError(f"pages must hold each page's bytes densely, got shape {tuple(pages.shape)} "
                             f"with strides {pages.stride()}")
        if page_bytes != 2 * side:
            raise ValueError(f"pages hold {page_bytes} bytes per page, expected 2 * {side} for "
                             f"page_size={page_size}, num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        page_stride = pages.stride(0)
        base = pages.storage_offset()

        def view(offset: int, nbytes: int) -> torch.Tensor:
            if head_major:
                strides = (page_stride, nbytes, page_size * nbytes, 1)
            else:
                strides = (page_stride, num_kv_heads * nbytes, nbytes, 1)
            return pages.as_strided((pages.shape[0], page_size, num_kv_heads, nbytes), strides, base + offset)

        data_b, sf_b = fmt.data_bytes(head_dim), fmt.scale_bytes(head_dim)
        data_len = page_size * num_kv_heads * data_b
        return cls(view(0, data_b), view(data_len, sf_b), view(side, data_b), view(side + data_len, sf_b), mode)

    @classmethod
    def from_token_rows(cls, k_data: torch.Tensor, k_block_scales: torch.Tensor, v_data: torch.Tensor,
                        v_block_scales: torch.Tensor, page_size: int = 1, mode: KVMode = KVMode()) -> "PagedKVCache":
        """SGLang's pool: per-layer rows ``[slots, heads, D/2]`` and ``[slots, heads, D/16]``.

        Slot s is token s % page_size of page s // page_size, so SGLang's page table entries
        (slot indices of page starts divided by page_size) index pages directly.
        """
        out = []
        for name, t in (("k_data", k_data), ("k_block_scales", k_block_scales),
                        ("v_data", v_data), ("v_block_scales", v_block_scales)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype == torch.float8_e4m3fn:
                t = t.view(torch.uint8)
            if t.dim() != 3:
                raise ValueError(f"{name} must be [slots, heads, bytes], got {tuple(t.shape)}")
            if t.shape[0] % page_size:
                raise ValueError(f"{name} has {t.shape[0]} slots, not a multiple of page_size={page_size}")
            out.append(t.unflatten(0, (t.shape[0] // page_size, page_size)))
        return cls(*out, mode=mode)
