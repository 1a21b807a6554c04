"""``reference.paged_attention_ref`` against an independent dense fp64 attention.

The oracle below walks requests one at a time: it dequantizes exactly the request's pages (in
block-table order) with ``format.dequantize``, builds dense K/V [L, Hkv, D], expands GQA with
``repeat_interleave`` and, per query token, slices the visible key range (bottom-right causal,
sliding window) out of K before a plain fp64 softmax with optional soft-cap and sink.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvfp4_backend import PagedKVCache, ops, reference
from nvfp4_backend import format as fmt


# ============================================================================ the oracle
def dense_attention_fp64(q, cache: PagedKVCache, block_table, seq_lens, query_start_loc, k_global_scale,
                         v_global_scale, softmax_scale, sliding_window=None, logits_soft_cap=None, sinks=None):
    num_q_heads = q.shape[1]
    group = num_q_heads // cache.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[b])
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len = q_end - q_start
        pages = block_table[b, :math.ceil(seq_len / cache.page_size)].long()

        def dense(data, scales, g):
            x = fmt.dequantize(data[pages], scales[pages], g, torch.float64)   # [pages, page, Hkv, D]
            return x.flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)    # [L, Hq, D]

        k = dense(cache.k_data, cache.k_block_scales, k_global_scale)
        v = dense(cache.v_data, cache.v_block_scales, v_global_scale)
        for i in range(q_len):
            pos = seq_len - q_len + i                     # bottom-right aligned
            first = max(0, pos - sliding_window + 1) if sliding_window else 0
            ks, vs = k[first:pos + 1], v[first:pos + 1]   # [n, Hq, D]
            logits = torch.einsum("hd,nhd->hn", q[q_start + i].double(), ks) * softmax_scale
            if logits_soft_cap:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            if sinks is not None:
                logits = torch.cat([logits, sinks.double()[:, None]], dim=1)
            p = torch.softmax(logits, dim=1)[:, :ks.shape[0]]
            out[q_start + i] = torch.einsum("hn,nhd->hd", p, vs)
    return out


# ============================================================================ the grid
@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    page_size: int
    head_dim: int
    group_size: int
    num_kv_heads: int = 2
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False


# Each axis value appears at least once; ragged lengths leave last pages partial.
CASES = {
    "decode_ps1_d64_mha": Case((7, 1, 33), (1, 1, 1), page_size=1, head_dim=64, group_size=1, num_kv_heads=4),
    "decode_ps16_d128_gqa4": Case((17, 40, 5), (1, 1, 1), 16, 128, 4),
    "decode_ps32_d256_gqa8": Case((31, 65), (1, 1), 32, 256, 8, num_kv_heads=1),
    "decode_ps64_d128_gqa16": Case((100, 63, 129), (1, 1, 1), 64, 128, 16, num_kv_heads=1),
    "decode_ps128_d64_gqa4": Case((129, 300), (1, 1), 128, 64, 4),
    "spec_q4_ps16_d128": Case((50, 18, 77), (4, 4, 4), 16, 128, 4, num_kv_heads=2),
    "spec_q8_ps32_d64_gqa16": Case((70, 9), (8, 8), 32, 64, 16, num_kv_heads=1),
    "mixed_q_ps16_d256_gqa1": Case((23, 8, 61, 2), (1, 3, 8, 2), 16, 256, 1, num_kv_heads=3),
    "prefill_whole_ps16": Case((12, 5), (12, 5), 16, 64, 4),
    "window_ps16_d128": Case((90, 37, 16), (1, 5, 2), 16, 128, 4, sliding_window=8),
    "window1_ps1": Case((9, 20), (3, 1), 1, 64, 8, num_kv_heads=1, sliding_window=1),
    "window_gt_seq_ps64": Case((45, 130), (2, 7), 64, 64, 4, sliding_window=100),
    "softcap_ps32_d128": Case((40, 97), (1, 6), 32, 128, 8, logits_soft_cap=2.0),
    "sinks_ps16_d64_gqa4": Case((3, 50, 19), (1, 2, 8), 16, 64, 4, sinks=True),
    "all_ps128_d256_gqa8": Case((140, 33), (5, 1), 128, 256, 8, num_kv_heads=1, sliding_window=20,
                                logits_soft_cap=1.5, sinks=True),
    "all_ps1_d128_gqa16": Case((6, 11), (6, 4), 1, 128, 16, num_kv_heads=1, sliding_window=3,
                               logits_soft_cap=30.0, sinks=True),
}


def build(case: Case, make_batch, gen, q_dtype):
    batch = make_batch(case.seq_lens, case.q_lens, page_size=case.page_size, num_kv_heads=case.num_kv_heads,
                       group_size=case.group_size, head_dim=case.head_dim, q_dtype=q_dtype,
                       k_global_scale=0.25, v_global_scale=1.5, generator=gen)
    cache = PagedKVCache.allocate(batch.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    for t in cache.tensors():                     # garbage (NaN scale bytes included) everywhere else
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    ops.write_kv(batch.key * 4, batch.value, batch.slot_mapping, cache, batch.k_global_scale, batch.v_global_scale)
    sinks = torch.randn(batch.q.shape[1], generator=gen) * 2 if case.sinks else None
    return batch, cache, sinks


def run_both(case, batch, cache, sinks, dtype):
    args = (batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
            batch.k_global_scale, batch.v_global_scale, batch.softmax_scale)
    kw = dict(sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap, sinks=sinks)
    got = reference.paged_attention_ref(*args, **kw, dtype=dtype)
    want = dense_attention_fp64(*args, **kw)
    return got, want


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_reference_matches_dense_fp64(name, q_dtype, make_batch, gen):
    case = CASES[name]
    batch, cache, sinks = build(case, make_batch, gen, q_dtype)
    got64, want = run_both(case, batch, cache, sinks, torch.float64)
    assert got64.dtype == torch.float64 and got64.shape == batch.q.shape
    torch.testing.assert_close(got64, want, rtol=1e-10, atol=1e-10)
    got32, _ = run_both(case, batch, cache, sinks, torch.float32)
    assert got32.dtype == torch.float32 and torch.isfinite(got32).all()
    torch.testing.assert_close(got32.double(), want, rtol=2e-5, atol=2e-5)


def test_reference_window_and_cap_change_the_answer(make_batch, gen):
    """Guards the grid against options that silently do nothing."""
    case = Case((60,), (4,), 16, 64, 2, sliding_window=5, logits_soft_cap=0.5, sinks=True)
    batch, cache, sinks = build(case, make_batch, gen, torch.float16)
    args = (batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
            batch.k_global_scale, batch.v_global_scale, batch.softmax_scale)
    plain = reference.paged_attention_ref(*args)
    for kw in (dict(sliding_window=5), dict(logits_soft_cap=0.5), dict(sinks=sinks)):
        assert (reference.paged_attention_ref(*args, **kw) - plain).abs().max() > 1e-3, kw


def test_reference_rows_with_no_visible_key_are_zero(make_batch, gen):
    """A query row past the request's query range (padding) is left as zeros, not NaN."""
    case = Case((20,), (3,), 16, 64, 2)
    batch, cache, _ = build(case, make_batch, gen, torch.float16)
    q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:], generator=gen).half()])
    out = reference.paged_attention_ref(q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        batch.k_global_scale, batch.v_global_scale, batch.softmax_scale)
    assert torch.isfinite(out).all() and out[3:].eq(0).all() and out[:3].ne(0).any()


def test_reference_block_table_with_extra_rows(make_batch, gen):
    """Graph-padded block tables (more rows than requests) are accepted by ops and must not change rows."""
    case = Case((20, 9), (2, 1), 16, 64, 4)
    batch, cache, _ = build(case, make_batch, gen, torch.float16)
    padded = torch.cat([batch.block_table, batch.block_table[:1]])
    args = (cache, batch.block_table, batch.seq_lens, batch.query_start_loc, batch.k_global_scale,
            batch.v_global_scale, batch.softmax_scale)
    want = reference.paged_attention_ref(batch.q, *args)
    got = reference.paged_attention_ref(batch.q, args[0], padded, *args[2:])
    assert torch.equal(got, want)


# ============================================================================ property-based
@st.composite
def small_cases(draw):
    batch = draw(st.integers(1, 3))
    seq_lens = tuple(draw(st.integers(1, 40)) for _ in range(batch))
    q_lens = tuple(draw(st.integers(1, min(s, 6))) for s in seq_lens)
    return Case(seq_lens, q_lens,
                page_size=draw(st.sampled_from([1, 2, 3, 8, 16])),
                head_dim=draw(st.sampled_from([16, 32, 64])),
                group_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
                num_kv_heads=draw(st.integers(1, 2)),
                sliding_window=draw(st.one_of(st.none(), st.integers(1, 45))),
                logits_soft_cap=draw(st.one_of(st.none(), st.floats(0.25, 50.0))),
                sinks=draw(st.booleans()))


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=small_cases(), q_dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**32 - 1))
def test_reference_matches_dense_fp64_hypothesis(case, q_dtype, seed, make_batch):
    gen = torch.Generator().manual_seed(seed)      # per example, so a shrunk failure replays exactly
    batch, cache, sinks = build(case, make_batch, gen, q_dtype)
    got, want = run_both(case, batch, cache, sinks, torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_defined_behaviour_for_bad_values(gen):
    """The semantics README's reliability section states, on the reference (the GPU suite checks
    the kernel gives the same NaN pattern): a NaN K block poisons the rows that see it, a NaN V
    block only its 16 output dims, a NaN query only its own (row, head), all-zero blocks read as
    exact zeros, and bytes no request owns (here NaN scales) never reach an output."""
    from gpu_cases import bad_values_case
    case = bad_values_case("cpu", gen)
    b = case.batch
    out = reference.paged_attention_ref(case.q, case.cache, b.block_table, b.seq_lens, b.query_start_loc,
                                        case.kg, case.vg, 0.1, dtype=torch.float64)
    assert torch.equal(torch.isnan(out), case.expect_nan)
    assert torch.equal(out[case.zero_rows], torch.zeros_like(out[case.zero_rows]))
