"""Cache layouts: NHD, HND, vLLM's inline page (both orders) and SGLang's token rows.

The same K/V written through ``ops.write_kv`` into every layout must give the same bytes in the
logical views, the same dequantized pages and bit-identical attention; and each view must put its
bytes where the engine's layout says (offsets computed by hand from the layout description).
"""
from __future__ import annotations

import pytest
import torch

from nvfp4_backend import PagedKVCache, ops, reference
from nvfp4_backend import format as fmt

LAYOUT_NAMES = ("NHD", "HND", "inline_head_major", "inline_token_major", "token_rows")


def make_layout(name: str, num_pages: int, page_size: int, heads: int, head_dim: int):
    """(cache, backing tensors) for one layout; the backing tensors are what the engine allocates."""
    db, sb = fmt.data_bytes(head_dim), fmt.scale_bytes(head_dim)
    if name in ("NHD", "HND"):
        cache = PagedKVCache.allocate(num_pages, page_size, heads, head_dim, layout=name)
        return cache, list(cache.tensors())
    if name.startswith("inline"):
        # vLLM hands [num_blocks, 2 * num_kv_heads, block_size, D/2 + D/16] uint8
        raw = torch.empty(num_pages, 2 * heads, page_size, db + sb, dtype=torch.uint8)
        return PagedKVCache.from_inline_pages(raw, page_size, heads, head_dim,
                                              head_major=name == "inline_head_major"), [raw]
    slots = num_pages * page_size
    rows = [torch.empty(slots, heads, n, dtype=torch.uint8) for n in (db, sb, db, sb)]
    return PagedKVCache.from_token_rows(*rows, page_size=page_size), rows


@pytest.mark.parametrize("page_size, heads, group, head_dim, q_lens", [
    (16, 2, 4, 128, (1, 1, 1)),
    (1, 1, 8, 64, (2, 1, 3)),
    (32, 4, 1, 256, (1, 4, 1)),
    (64, 2, 16, 64, (8, 1, 2)),
    (128, 1, 4, 128, (1, 1, 5)),
])
def test_layouts_agree(page_size, heads, group, head_dim, q_lens, make_batch, gen):
    seq_lens = (3 * page_size + 5, page_size, 2 if page_size > 1 else 7)
    seq_lens = tuple(max(s, q) for s, q in zip(seq_lens, q_lens))
    batch = make_batch(seq_lens, q_lens, page_size=page_size, num_kv_heads=heads, group_size=group,
                       head_dim=head_dim, q_dtype=torch.bfloat16, k_global_scale=0.125, v_global_scale=3.0)
    # the same logical garbage in every layout before the write (NaN scale bytes included)
    pattern = [torch.randint(0, 256, (batch.num_pages, page_size, heads, n), dtype=torch.uint8, generator=gen)
               for n in (head_dim // 2, head_dim // 16) * 2]
    sinks = torch.randn(batch.q.shape[1], generator=gen)
    views, dense, outs = {}, {}, {}
    for name in LAYOUT_NAMES:
        cache, backing = make_layout(name, batch.num_pages, page_size, heads, head_dim)
        for b in backing:
            b.fill_(0xA5)
        for view, p in zip(cache.tensors(), pattern):
            view.copy_(p)
        ops.write_kv(batch.key, batch.value, batch.slot_mapping, cache, batch.k_global_scale, batch.v_global_scale)
        views[name] = [t.clone() for t in cache.tensors()]
        dense[name] = reference.gather_kv_ref(cache, batch.block_table, batch.seq_lens, batch.k_global_scale,
                                              batch.v_global_scale)
        out = torch.full_like(batch.q, float("nan"))
        res = ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                  batch.k_global_scale, batch.v_global_scale, batch.softmax_scale,
                                  sliding_window=page_size + 3, logits_soft_cap=20.0, sinks=sinks, out=out)
        assert res is out and not out.isnan().any(), name
        outs[name] = out
        for b in backing:                      # the views cover every byte the engine allocated
            assert not b.eq(0xA5).all(dim=-1).any(), name

    first = LAYOUT_NAMES[0]
    written = torch.zeros(batch.num_pages * page_size, dtype=torch.bool)
    written[batch.slot_mapping] = True
    written = written.view(batch.num_pages, page_size)
    for name in LAYOUT_NAMES[1:]:
        for a, b in zip(views[first], views[name]):
            assert torch.equal(a, b), name
        for a, b in zip(dense[first], dense[name]):
            assert torch.equal(a, b), name
        assert torch.equal(outs[first], outs[name]), name
    # untouched slots still hold the pattern; written ones hold the quantized K/V
    for view, p in zip(views[first], pattern):
        assert torch.equal(view[~written], p[~written])
    kd, ks = fmt.quantize(batch.key, batch.k_global_scale)
    page, off = batch.slot_mapping // page_size, batch.slot_mapping % page_size
    assert torch.equal(views[first][0][page, off], kd) and torch.equal(views[first][1][page, off], ks)


# ============================================================================ byte placement
def offsets(name: str, page_size: int, heads: int, head_dim: int):
    """Flat byte offset inside one page (or one token row) of K data, K scales, V data, V scales
    for [page_size, heads, bytes], from each engine's layout description."""
    db, sb = fmt.data_bytes(head_dim), fmt.scale_bytes(head_dim)
    t = torch.arange(page_size)[:, None, None]
    h = torch.arange(heads)[None, :, None]
    side = page_size * heads * (db + sb)
    out = []
    data_len = page_size * heads * db       # each side: [data | scales]
    for base, n, first in ((0, db, 0), (0, sb, data_len), (side, db, 0), (side, sb, data_len)):
        b = torch.arange(n)[None, None, :]
        if name == "inline_head_major":       # [heads, page_size, n] per part
            off = first + h * page_size * n + t * n + b
        elif name == "inline_token_major":    # [page_size, heads, n] per part
            off = first + t * heads * n + h * n + b
        else:
            raise AssertionError(name)
        out.append(base + off)
    return out


@pytest.mark.parametrize("name", ["inline_head_major", "inline_token_major"])
@pytest.mark.parametrize("page_size, heads, head_dim", [(1, 1, 16), (16, 2, 128), (3, 5, 64)])
def test_inline_byte_placement(name, page_size, heads, head_dim, gen):
    num_pages = 4
    cache, (raw,) = make_layout(name, num_pages, page_size, heads, head_dim)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    flat = raw.view(num_pages, -1)
    for view, off in zip(cache.tensors(), offsets(name, page_size, heads, head_dim)):
        assert torch.equal(view, flat[:, off]), name


@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_hnd_and_token_row_placement(page_size, gen):
    num_pages, heads, head_dim = 3, 2, 64
    hnd, backing = make_layout("HND", num_pages, page_size, heads, head_dim)
    for view, b in zip(hnd.tensors(), backing):
        # allocate() returns the views; their storage is [pages, heads, page_size, n] row-major
        n = view.shape[-1]
        assert view.stride() == (heads * page_size * n, n, page_size * n, 1)
        raw = torch.randint(0, 256, (num_pages * heads * page_size * n,), dtype=torch.uint8, generator=gen)
        b.untyped_storage().copy_(raw.untyped_storage())
        assert torch.equal(view, raw.view(num_pages, heads, page_size, n).transpose(1, 2))
    rows_cache, rows = make_layout("token_rows", num_pages, page_size, heads, head_dim)
    for view, r in zip(rows_cache.tensors(), rows):
        r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=gen))
        slot = torch.arange(num_pages * page_size)
        assert torch.equal(view[slot // page_size, slot % page_size], r)   # slot s = page s//ps, token s%ps


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_token_major(name, page_size):
    """A token's kv heads side by side: token-major layouts at every page size, head-major ones only
    with one token per page (where their bytes are the same)."""
    cache, _ = make_layout(name, 4, page_size, 3, 128)
    assert cache.token_major == (name in ("NHD", "inline_token_major", "token_rows") or page_size == 1)


def test_token_rows_accept_fp8_scale_tensors(gen):
    rows = [torch.randint(0, 256, (32, 2, n), dtype=torch.uint8, generator=gen) for n in (32, 4, 32, 4)]
    fp8 = [r.view(torch.float8_e4m3fn) if i % 2 else r for i, r in enumerate(rows)]
    a = PagedKVCache.from_token_rows(*rows, page_size=16)
    b = PagedKVCache.from_token_rows(*fp8, page_size=16)
    for x, y in zip(a.tensors(), b.tensors()):
        assert y.dtype == torch.uint8 and torch.equal(x, y)


# ============================================================================ constructor errors
def test_allocate_rejects():
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache.allocate(2, 16, 2, 40)
    with pytest.raises(ValueError, match="layout"):
        PagedKVCache.allocate(2, 16, 2, 64, layout="HDN")


def test_inline_rejects(gen):
    raw = torch.zeros(2, 4, 16, 36, dtype=torch.uint8)
    with pytest.raises(TypeError, match="pages"):
        PagedKVCache.from_inline_pages(raw.to(torch.int8), 16, 2, 64, head_major=True)
    with pytest.raises(ValueError, match="pages"):
        PagedKVCache.from_inline_pages(raw, 16, 4, 64, head_major=True)       # twice the heads
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache.from_inline_pages(raw, 16, 2, 72, head_major=True)
    wide = torch.zeros(2, 4, 16, 40, dtype=torch.uint8)[..., :36]             # page bytes not dense
    with pytest.raises(ValueError, match="pages"):
        PagedKVCache.from_inline_pages(wide, 16, 2, 64, head_major=False)


def test_token_rows_reject():
    good = [torch.zeros(32, 2, n, dtype=torch.uint8) for n in (32, 4, 32, 4)]
    with pytest.raises(ValueError, match="v_data"):
        PagedKVCache.from_token_rows(good[0], good[1], good[2][0], good[3], page_size=16)
    with pytest.raises(ValueError, match="k_data"):
        PagedKVCache.from_token_rows(*good, page_size=5)
    with pytest.raises(TypeError, match="k_block_scales"):
        PagedKVCache.from_token_rows(good[0], None, good[2], good[3], page_size=16)
    with pytest.raises(TypeError, match="v_block_scales"):
        PagedKVCache.from_token_rows(good[0], good[1], good[2], good[3].float(), page_size=16)


@pytest.mark.parametrize("field", ["k_data", "k_block_scales", "v_data", "v_block_scales"])
def test_cache_validation_names_the_tensor(field):
    parts = dict(zip(("k_data", "k_block_scales", "v_data", "v_block_scales"),
                     PagedKVCache.allocate(2, 16, 2, 64).tensors()))
    bad = {
        "missing": None,
        "dtype": parts[field].to(torch.int8),
        "dims": parts[field][0],
        "stride": torch.zeros(*parts[field].shape[:-1], parts[field].shape[-1] * 2, dtype=torch.uint8)[..., ::2],
        "shape": parts[field][..., :-2],
        "device": parts[field].to("meta"),
    }
    for what, t in bad.items():
        kwargs = dict(parts, **{field: t})
        with pytest.raises((TypeError, ValueError), match=field):
            PagedKVCache(**kwargs)
    # head_dim not a multiple of 16: D/2 = 20 -> D = 40
    odd = {"k_data": (2, 16, 2, 20), "k_block_scales": (2, 16, 2, 2),
           "v_data": (2, 16, 2, 20), "v_block_scales": (2, 16, 2, 2)}
    with pytest.raises(ValueError, match="k_data"):
        PagedKVCache(**{k: torch.zeros(s, dtype=torch.uint8) for k, s in odd.items()})
