"""The benchmark's CPU-checkable parts: the views it hands FlashInfer (its peer must read the very
bytes and shapes ours reads, or the comparison measures another problem)."""
from __future__ import annotations

import pytest
import torch

from nvfp4_backend.tools.bench import flashinfer_kv
from nvfp4_backend.layout import PagedKVCache


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_nvfp4_views_follow_its_layout(layout):
    pages, ps, hkv, d = 5, 16, 4, 128
    cache = PagedKVCache.allocate(pages, ps, hkv, d, layout)
    for t in cache.tensors():
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    k, v, dt, kw, bpe = flashinfer_kv("nvfp4", cache, layout, torch.tensor(0.5), torch.tensor(0.25), "cpu")
    k_sf, v_sf = kw["kv_cache_sf"]
    want = (pages, ps, hkv) if layout == "NHD" else (pages, hkv, ps)
    for t, n in ((k, d // 2), (v, d // 2), (k_sf, d // 16), (v_sf, d // 16)):
        assert t.shape == (*want, n) and t.is_contiguous()  # FlashInfer reads dense pages in its layout
    p, tok, h = 3, 7, 2
    at = (p, tok, h) if layout == "NHD" else (p, h, tok)
    assert torch.equal(k[at], cache.k_data[p, tok, h]) and torch.equal(v[at], cache.v_data[p, tok, h])
    assert torch.equal(k_sf[at].view(torch.uint8), cache.k_block_scales[p, tok, h])
    assert (dt, kw["k_scale"], kw["v_scale"], bpe) == (torch.uint8, 0.5, 0.25, 72 / 128)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flashinfer_dense_peers_have_its_shape(layout):
    cache = PagedKVCache.allocate(3, 16, 2, 64, layout)
    k, v, dt, kw, bpe = flashinfer_kv("fp8", cache, layout, 1.0, 1.0, "cpu")
    assert k.shape == ((3, 16, 2, 64) if layout == "NHD" else (3, 2, 16, 64)) and dt == torch.float8_e4m3fn
