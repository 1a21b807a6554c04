"""The extend (prefill) path on a GPU: the gather kernel bit for bit, then gather + SDPA against the fp64
reference (skipped without a GPU)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from gpu_cases import LAYOUTS, fill_random, make_batch, make_cache, rel_l2
from kernel_checks import DEV, TOL, scales
from nvfp4_backend import capabilities, extend, jit, ops, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_kv_bit_exact(layout, head_dim, dtype, gen):
    """The gather kernel's packed rows == the reference's dequantization (no global scale), bit for
    bit, over every scale byte (NaN, zero and subnormal scales included); every row is written."""
    page_size = 1 if layout == "token_rows" else 16
    seq_lens = [0, 1, 37, 300, 16 * int(torch.randint(1, 20, (), generator=gen))]
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, 3, head_dim, DEV)
    fill_random(cache, gen, 0, 256)
    assert extend._gather_kernel_serves(cache)
    batch = make_batch(seq_lens, [1] * len(seq_lens), 3, head_dim, page_size, pages, dtype, gen, DEV)
    starts = [0] + list(itertools.accumulate(seq_lens))
    k = torch.full((starts[-1], 3, head_dim), float("nan"), dtype=dtype, device=DEV)
    v = torch.full_like(k, float("nan"))
    jit.load(torch.device(DEV)).gather_kv(*cache.tensors(), batch.block_table, batch.seq_lens,
                                          torch.tensor(starts[:-1], device=DEV), max(seq_lens), k, v)
    one = torch.tensor(1.0, device=DEV)
    k_ref, v_ref = reference.gather_kv_ref(cache, batch.block_table, batch.seq_lens, one, one, dtype)
    for got, ref in ((k, k_ref), (v, v_ref)):
        want = torch.cat([ref[b, :n] for b, n in enumerate(seq_lens)])
        nan = torch.isnan(want)
        assert nan.any() and torch.equal(torch.isnan(got), nan), "NaN pattern differs (or a row was not written)"
        bits_got, bits_want = got.view(torch.int16), want.view(torch.int16)
        assert torch.equal(bits_got[~nan], bits_want[~nan]), f"{int((bits_got != bits_want)[~nan].sum())} values differ"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gather_tokens", [100, 1 << 16])
def test_extend_path_matches_reference(layout, dtype, gather_tokens, gen, monkeypatch):
    """Prefill and chunked prefill past the decode kernel's rows (gather kernel + SDPA), requests
    dequantized one per launch or together, a request without queries in the batch."""
    monkeypatch.setattr(extend, "EXTEND_GATHER_TOKENS", gather_tokens)
    page_size, kv_heads, group, head_dim = (1 if layout == "token_rows" else 16), 2, 4, 128
    seq_lens, q_lens = [300, 700, 90, 129], [300, 200, 0, 129]  # prefill, chunked prefill, idle, prefill
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, kv_heads * group, head_dim, page_size, pages, dtype, gen, DEV)
    kg, vg = scales(gen)
    assert not capabilities.decode_supports(group, batch.max_query_len, head_dim)  # the dense path serves it
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                        1 / math.sqrt(head_dim), max_query_len=batch.max_query_len, out=out)
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, 1 / math.sqrt(head_dim), dtype=torch.float64)
    assert not torch.isnan(out).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out, ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL} ({layout}, {dtype})"
