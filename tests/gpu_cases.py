"""Random caches and batches shared by the GPU kernel tests and the benchmark."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvfp4_backend import PagedKVCache, format as fmt

LAYOUTS = ("NHD", "HND", "inline_hnd", "inline_nhd", "token_rows")


def make_cache(layout: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, device) -> PagedKVCache:
    """An empty cache in one of the engines' layouts (all views of freshly allocated memory)."""
    if layout in ("NHD", "HND"):
        return PagedKVCache.allocate(num_pages, page_size, num_kv_heads, head_dim, layout, device)
    if layout.startswith("inline"):
        width = fmt.bytes_per_token_head(head_dim)
        raw = torch.zeros(num_pages, 2 * num_kv_heads, page_size, width, dtype=torch.uint8, device=device)
        return PagedKVCache.from_inline_pages(raw, page_size, num_kv_heads, head_dim, head_major=layout == "inline_hnd")
    slots = num_pages * page_size
    rows = [torch.zeros(slots, num_kv_heads, n, dtype=torch.uint8, device=device)
            for n in (fmt.data_bytes(head_dim), fmt.scale_bytes(head_dim))]
    return PagedKVCache.from_token_rows(rows[0], rows[1], rows[0].clone(), rows[1].clone(), page_size)


def fill_random(cache: PagedKVCache, gen: torch.Generator, scale_lo: int = 0x28, scale_hi: int = 0x48) -> None:
    """Random E2M1 codes and E4M3 block scales in [scale_lo, scale_hi) (bytes), written in place."""
    for t in (cache.k_data, cache.v_data):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    for t in (cache.k_block_scales, cache.v_block_scales):
        t.copy_(torch.randint(scale_lo, scale_hi, t.shape, generator=gen, dtype=torch.uint8))


@dataclass
class Batch:
    q: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


def make_batch(seq_lens: list[int], q_lens: list[int], num_q_heads: int, head_dim: int, page_size: int,
               num_pages: int, dtype, gen: torch.Generator, device) -> Batch:
    """Ragged requests whose pages are a random permutation of the cache (page 0 held back)."""
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    width = max(max(pages_needed), 1)
    perm = torch.randperm(num_pages - 1, generator=gen, device="cpu")[: sum(pages_needed)] + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen, device="cpu").to(dtype)
    return Batch(q.to(device), table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 qsl.to(device), max(q_lens))


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
