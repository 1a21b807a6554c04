"""The extend path (``extend.extend_attention``) on CPU: its chunking, its SDPA path's request groups
and lossless workspace, against the reference."""
from __future__ import annotations

import pytest
import torch

from nvfp4_backend import PagedKVCache, extend, ops, reference


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_extend_attention_matches_reference(chunk, make_batch, gen, monkeypatch):
    """The GPU extend (chunked prefill) path is plain torch: check its chunking on CPU."""
    step = make_batch((40, 9, 23), (11, 9, 1), page_size=16, num_kv_heads=2, group_size=4, head_dim=64)
    cache = PagedKVCache.allocate(step.num_pages, 16, 2, 64, layout="HND")
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    sinks = torch.randn(step.q.shape[1], generator=gen)
    args = (step.q, cache, step.block_table, step.seq_lens, step.query_start_loc, step.k_global_scale,
            step.v_global_scale, step.softmax_scale, 6, 8.0, sinks)
    monkeypatch.setattr(extend, "EXTEND_CHUNK_TOKENS", chunk)
    got = extend.extend_attention(*args)
    want = reference.paged_attention_ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gather_tokens", [1, 100, 1 << 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_attention_sdpa_path_matches_reference(dtype, gather_tokens, make_batch, gen, monkeypatch):
    """Plain causal extends go through SDPA on a lossless q-dtype workspace (global scales folded
    into the softmax scale and the output): the reference up to q-dtype rounding, whether the
    requests are dequantized one per pass (1), in groups (100) or all together."""
    monkeypatch.setattr(extend, "EXTEND_GATHER_TOKENS", gather_tokens)
    step = make_batch((40, 9, 23, 64), (11, 9, 1, 64), page_size=16, num_kv_heads=2, group_size=4, head_dim=64,
                      q_dtype=dtype, k_global_scale=0.37, v_global_scale=3.1)
    cache = PagedKVCache.allocate(step.num_pages, 16, 2, 64, layout="NHD")
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    args = (step.q, cache, step.block_table, step.seq_lens, step.query_start_loc, torch.tensor(step.k_global_scale),
            torch.tensor(step.v_global_scale), step.softmax_scale)
    got = extend.extend_attention(*args)
    want = reference.paged_attention_ref(*args, dtype=torch.float64)
    assert float((got.double() - want).norm() / want.norm()) < 4e-3
    # the workspace itself is exact: dequantized without the global scale, in fp16 or bf16
    k64, _ = reference.gather_kv_ref(cache, step.block_table[:1], step.seq_lens[:1], torch.tensor(1.0),
                                     torch.tensor(1.0), torch.float64)
    for work in (torch.float16, torch.bfloat16):
        k, _ = reference.gather_kv_ref(cache, step.block_table[:1], step.seq_lens[:1], torch.tensor(1.0),
                                       torch.tensor(1.0), work)
        assert torch.equal(k.double(), k64)


def test_extend_attention_groups_do_not_change_the_result(make_batch, monkeypatch):
    """Requests dequantized together or one per group (EXTEND_GATHER_REQUESTS = 1, as a batch past
    the gather kernel's 65535 grid rows is split) give identical outputs."""
    step = make_batch((40, 9, 23, 64), (11, 9, 1, 64), page_size=16, num_kv_heads=2, group_size=4, head_dim=64,
                      q_dtype=torch.float16, k_global_scale=0.37, v_global_scale=3.1)
    cache = PagedKVCache.allocate(step.num_pages, 16, 2, 64, layout="NHD")
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    args = (step.q, cache, step.block_table, step.seq_lens, step.query_start_loc, torch.tensor(step.k_global_scale),
            torch.tensor(step.v_global_scale), step.softmax_scale)
    together = extend.extend_attention(*args)
    monkeypatch.setattr(extend, "EXTEND_GATHER_REQUESTS", 1)
    assert torch.equal(extend.extend_attention(*args), together)


def test_extend_attention_bf16_queries_past_fp16_range(make_batch):
    step = make_batch((30,), (30,), page_size=16, num_kv_heads=1, group_size=2, head_dim=64,
                      q_dtype=torch.bfloat16)
    cache = PagedKVCache.allocate(step.num_pages, 16, 1, 64)
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, 1.0, 1.0)
    q = step.q * 1e5  # past fp16's range: the bf16 workspace serves it
    args = (q, cache, step.block_table, step.seq_lens, step.query_start_loc, torch.tensor(1.0), torch.tensor(1.0),
            1e-6)
    got = extend.extend_attention(*args)
    want = reference.paged_attention_ref(*args, dtype=torch.float64)
    assert torch.isfinite(got).all() and float((got.double() - want).norm() / want.norm()) < 1e-2
