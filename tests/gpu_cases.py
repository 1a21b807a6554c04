"""Random caches and batches shared by the GPU kernel tests and the benchmark."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvfp4_backend import PagedKVCache, format as fmt

LAYOUTS = ("NHD", "HND", "inline_hnd", "inline_nhd", "token_rows")


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """Same values, starting one element past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    return buf[1:1 + t.numel()].view(t.shape).copy_(t)


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
    """Ragged requests whose pages are a random permutation of the cache (page 0 held back).  Table
    entries past a request's pages hold an index far past the cache, so a kernel that copied from one
    would fault instead of reading some other page."""
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    width = max(max(pages_needed), 1)
    perm = torch.randperm(num_pages - 1, generator=gen, device="cpu")[: sum(pages_needed)] + 1
    table = torch.full((len(seq_lens), width), 2**31 - 1, dtype=torch.int32)
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


@dataclass
class BadValuesCase:
    """A decode batch whose cache and queries hold the values the format defines behaviour for."""
    q: torch.Tensor
    cache: PagedKVCache
    batch: Batch
    kg: torch.Tensor
    vg: torch.Tensor
    expect_nan: torch.Tensor  # [tokens, q_heads, D] bool: where the output must be NaN
    zero_rows: list[int]       # query rows of the request whose cache is all-zero blocks


def bad_values_case(device, gen: torch.Generator) -> BadValuesCase:
    """Four decode requests (q_len 1, GQA 4, 2 kv heads, D 128, page 16), each position visible:
      0: a NaN K block (E4M3 NaN scale) at position 5, kv head 0: kv head 0's rows all NaN;
      1: a NaN V block at position 3, kv head 1, block 2: kv head 1's rows NaN in dims 32..47;
      2: a NaN in the query of head 6: that (row, head) NaN, all else finite;
      3: every block of its cache all-zero (scale 0): its rows are exactly 0;
    plus NaN scales in every slot no request owns (stale bytes must not leak)."""
    hkv, group, d, ps = 2, 4, 128, 16
    seq_lens = [40, 33, 17, 20]
    cache = make_cache("NHD", 12, ps, hkv, d, device)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, [1] * 4, hkv * group, d, ps, 12, torch.bfloat16, gen, device)
    table = batch.block_table.cpu()
    owned = torch.zeros(12, ps, dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        for p in range(s):
            owned[table[b, p // ps], p % ps] = True
    for t in (cache.k_block_scales, cache.v_block_scales):
        t[~owned.to(device)] = fmt.E4M3_NAN_BYTE

    def at(b, pos):
        return int(table[b, pos // ps]), pos % ps

    cache.k_block_scales[at(0, 5) + (0, 3)] = fmt.E4M3_NAN_BYTE
    cache.v_block_scales[at(1, 3) + (1, 2)] = fmt.E4M3_NAN_BYTE
    batch.q[2, 6, 10] = float("nan")
    for p in range(seq_lens[3]):
        for t in (cache.k_block_scales, cache.v_block_scales):
            t[at(3, p)] = 0
    expect = torch.zeros(4, hkv * group, d, dtype=torch.bool)
    expect[0, :group] = True
    expect[1, group:, 32:48] = True
    expect[2, 6] = True
    return BadValuesCase(batch.q, cache, batch, torch.tensor(0.5, device=device), torch.tensor(0.25, device=device),
                         expect, [3])
