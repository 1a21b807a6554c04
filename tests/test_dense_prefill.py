"""The dense prefill path on the CPU: its pass planning, the dequantize op, and whole steps run with an fp64
stand-in for the dense kernel (reference.RaggedAttentionRef) against the paged fp64 reference.  The GPU
side (the CUDA dequantizer and FlashInfer's FA3) is tests/gpu/test_dense.py."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import LAYOUTS, fill_random, make_batch, make_cache, rel_l2
from nvfp4_backend import PagedKVCache, format as fmt, ops, planner, reference
from nvfp4_backend.dense_plan import attention_pairs, extend_requests, plan_passes
from nvfp4_backend.dense_prefill import DENSE_MIN_FLOPS, DensePrefill
from nvfp4_backend.modes import KVMode


# ----------------------------------------------------------------------------- planning
def covered(passes, b):
    """The cache positions request b's segments read, per kind of pass."""
    out = {True: [], False: []}
    for p in passes:
        for s in p.segments:
            if s.request == b:
                out[p.causal].extend(range(s.position, s.position + s.length))
    return out


def test_extend_requests_span_the_long_ones():
    assert extend_requests([1, 1, 5, 9], 1) == range(2, 4)
    assert extend_requests([7, 1, 1], 2) == range(0, 1)
    assert extend_requests([1, 1], 1) is None
    assert extend_requests([5, 1, 3, 5, 1], 1) == range(0, 4)  # short ones between long ones ride along


def test_one_causal_pass_when_the_step_fits():
    passes = plan_passes([1, 100, 40], [500, 1300, 40], range(1, 3), None, capacity=1340)
    assert len(passes) == 1 and passes[0].causal and passes[0].first_request == 1
    assert [(s.request, s.position, s.length) for s in passes[0].segments] == [(1, 0, 1300), (2, 0, 40)]


@pytest.mark.parametrize("capacity", [252, 257, 1000, 4096])
def test_prefix_chunks_cover_every_position_once(capacity):
    q_lens, seq_lens = [1, 100, 30, 1, 120], [9, 5000, 30, 1, 700]
    passes = plan_passes(q_lens, seq_lens, range(0, 5), None, capacity)
    if sum(seq_lens) <= capacity:
        assert len(passes) == 1
        return
    assert passes[0].causal and not any(p.causal for p in passes[1:])
    for p in passes:
        assert 0 < p.rows <= capacity
        assert [s.request for s in p.segments] == list(range(p.first_request, p.last_request))
    for b in range(5):
        parts = covered(passes, b)
        assert parts[True] == list(range(seq_lens[b] - q_lens[b], seq_lens[b]))
        assert sorted(parts[False]) == list(range(seq_lens[b] - q_lens[b]))


def test_a_window_reads_its_span_only_and_never_chunks():
    passes = plan_passes([64, 10], [5000, 10], range(0, 2), 128, capacity=4096)
    assert [(s.position, s.length) for s in passes[0].segments] == [(5000 - 64 - 127, 64 + 127), (0, 10)]
    assert plan_passes([64], [5000], range(0, 1), 128, capacity=150) is None
    assert plan_passes([200], [5000], range(0, 1), None, capacity=150) is None  # queries beyond the workspace


def test_plan_passes_rejects_queries_longer_than_the_sequence():
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        plan_passes([10], [5], range(0, 1), None, capacity=100)


# ----------------------------------------------------------------------------- the op
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantize_kv_cpu_is_the_reference_gather(layout, gen):
    page_size, heads, head_dim = 16, 2, 64
    cache = make_cache(layout, 12, page_size, heads, head_dim, "cpu")
    fill_random(cache, gen)
    block_table = torch.randperm(12, generator=gen).to(torch.int32).view(2, 6)
    segments = torch.tensor([[0, 30, 70], [1, 0, 0], [50, 3, 0]], dtype=torch.int32)
    k = torch.full((70, heads, head_dim), float("nan"), dtype=torch.bfloat16)
    v = k.clone()
    kg, vg = torch.tensor(0.75), torch.tensor(1.5)
    torch.ops.nvfp4_backend.dequantize_kv(k, v, *cache.tensors(), block_table, segments, kg, vg)
    ks, vs = reference.gather_kv_ref(cache, block_table, torch.tensor([96, 96]), kg, vg)
    want_k = torch.cat([ks[1, 50:80], ks[0, 3:43]])
    want_v = torch.cat([vs[1, 50:80], vs[0, 3:43]])
    assert torch.equal(k, want_k.to(torch.bfloat16)) and torch.equal(v, want_v.to(torch.bfloat16))


# ----------------------------------------------------------------------------- whole steps
STEPS = {  # name: (seq_lens, q_lens), decodes first as vLLM orders them
    "mixed": ([300, 77, 1200, 513], [1, 1, 200, 513]),
    "prefill": ([700], [700]),
    "sglang_order": ([900, 64, 50], [300, 1, 1]),
    "short_between_long": ([500, 60, 70, 500, 30], [200, 1, 3, 200, 1]),  # short ones ride along
}


def run_step(seq_lens, q_lens, *, gen, layout="HND", head_dim=64, group=4, kv_heads=2, workspace_tokens=None,
             window=None, soft_cap=None, sinks=False, rotation="none", dtype=torch.bfloat16):
    page_size = 16
    pages = sum(-(-s // page_size) for s in seq_lens) + 4
    cache = PagedKVCache(*make_cache(layout, pages, page_size, kv_heads, head_dim, "cpu").tensors(),
                         mode=KVMode(rotation=rotation))
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, group * kv_heads, head_dim, page_size, pages, dtype, gen, "cpu")
    kg, vg = torch.tensor(0.5), torch.tensor(1.25)
    sink = torch.randn(group * kv_heads, generator=gen) if sinks else None
    attention = reference.RaggedAttentionRef()
    row_bytes = 2 * kv_heads * head_dim * dtype.itemsize
    capacity = workspace_tokens or sum(seq_lens)
    dense = DensePrefill("cpu", group * kv_heads, kv_heads, head_dim, dtype, max_query_tokens=sum(q_lens),
                         workspace_bytes=max(capacity, sum(q_lens)) * row_bytes, attention=attention)
    base = planner.plan_attention(len(seq_lens), kv_heads, group, max(q_lens), max(seq_lens), head_dim, 132,
                                  query_lens=q_lens)
    plan = dense.plan(base, q_lens, seq_lens, softmax_scale=head_dim ** -0.5, sliding_window=window,
                      logits_soft_cap=soft_cap)
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                        head_dim ** -0.5, sliding_window=window, logits_soft_cap=soft_cap, sinks=sink, out=out,
                        plan=plan, max_query_len=max(q_lens))
    q = fmt.hadamard_transform(batch.q.float()) if rotation == "hadamard" else batch.q
    ref = reference.paged_attention_ref(q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                                        head_dim ** -0.5, window, soft_cap, sink, dtype=torch.float64)
    if rotation == "hadamard":
        ref = fmt.hadamard_transform(ref.float()).double()
    return plan, attention, out, ref


@pytest.mark.parametrize("name", sorted(STEPS))
def test_a_step_through_the_dense_path_is_the_reference(name, gen):
    plan, attention, out, ref = run_step(*STEPS[name], gen=gen)
    assert plan.prefill is not None and attention.runs == 1
    assert rel_l2(out, ref) < 4e-3 and not out.isnan().any()


@pytest.mark.parametrize("features", [dict(window=100), dict(soft_cap=5.0), dict(sinks=True),
                                      dict(window=64, sinks=True, soft_cap=8.0)])
def test_features_through_the_dense_path(features, gen):
    plan, attention, out, ref = run_step(*STEPS["mixed"], gen=gen, **features)
    assert plan.prefill is not None
    assert rel_l2(out, ref) < 4e-3 and not out.isnan().any()


@pytest.mark.parametrize("sinks", [False, True])
def test_kv_chunks_merge_by_log_sum_exp(sinks, gen):
    seq_lens, q_lens = [300, 1500, 40, 900], [1, 120, 40, 64]
    plan, attention, out, ref = run_step(seq_lens, q_lens, gen=gen, workspace_tokens=400, sinks=sinks)
    assert len(plan.prefill.passes) > 2 and attention.runs == len(plan.prefill.passes)
    assert rel_l2(out, ref) < 4e-3 and not out.isnan().any()


def test_reserve_merge_makes_the_buffer_multi_pass_steps_use():
    """An engine that profiles memory reserves the merge buffer up front; a multi-pass plan then uses
    it (no allocation of its own), and reserving twice makes nothing new."""
    dense = DensePrefill("cpu", 8, 2, 64, torch.bfloat16, max_query_tokens=240, workspace_bytes=400 * 2 * 2 * 64 * 2)
    before = dense.allocated_bytes
    dense.reserve_merge()
    merge = dense.merge_out
    assert dense.allocated_bytes - before == 240 * 8 * 64 * 2
    dense.reserve_merge()
    assert dense.merge_out is merge
    q_lens, seq_lens = [1, 120, 40, 64], [300, 1500, 40, 900]
    base = planner.plan_attention(4, 2, 4, 120, 1500, 64, 132, query_lens=q_lens)
    plan = dense.plan(base, q_lens, seq_lens, softmax_scale=0.125)
    assert len(plan.prefill.passes) > 2 and dense.merge_out is merge


def test_a_hadamard_cache_keeps_the_prefill_kernel(gen):
    plan, attention, out, ref = run_step(*STEPS["mixed"], gen=gen, rotation="hadamard")
    assert plan.prefill is not None and attention.runs == 0  # planned, but the call kept the kernels' path
    assert rel_l2(out, ref) < 4e-3 and not out.isnan().any()


def test_steps_the_path_does_not_take_keep_the_kernels(gen):
    plan, _, out, ref = run_step([5000, 100], [64, 100], gen=gen, window=512, workspace_tokens=300)
    assert plan.prefill is None and rel_l2(out, ref) < 4e-3 and not out.isnan().any()


# ----------------------------------------------------------------------------- arguments
def test_dense_prefill_rejects_bad_configuration():
    with pytest.raises(ValueError, match="max_query_tokens"):
        DensePrefill("cpu", 8, 2, 64, torch.bfloat16, max_query_tokens=1000, workspace_bytes=1000,
                     attention=reference.RaggedAttentionRef())
    with pytest.raises(TypeError, match="dtype"):
        DensePrefill("cpu", 8, 2, 64, torch.float32, max_query_tokens=10, attention=reference.RaggedAttentionRef())
    with pytest.raises(ValueError, match="num_q_heads"):
        DensePrefill("cpu", 7, 2, 64, torch.bfloat16, max_query_tokens=10, attention=reference.RaggedAttentionRef())


@pytest.mark.parametrize("mutate, name", [
    (dict(softmax_scale=0.3), "softmax_scale"),
    (dict(sliding_window=64), "sliding_window"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap"),
])
def test_a_call_that_differs_from_its_plan_is_rejected(mutate, name, gen):
    seq_lens, q_lens = STEPS["mixed"]
    plan, _, _, _ = run_step(seq_lens, q_lens, gen=gen)
    cache = make_cache("HND", 200, 16, 2, 64, "cpu")
    batch = make_batch(seq_lens, q_lens, 8, 64, 16, 200, torch.bfloat16, gen, "cpu")
    args = dict(softmax_scale=64 ** -0.5, sliding_window=None, logits_soft_cap=None)
    args.update(mutate)
    scale = args.pop("softmax_scale")
    with pytest.raises(ValueError, match=name):
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1.0, 1.0, scale,
                            plan=plan, max_query_len=max(q_lens), **args)


def test_a_step_plans_each_layer_feature_set_apart(gen):
    # Alternating windowed and full layers (gpt-oss): both plans live through the step's layers.
    seq_lens, q_lens = [400, 700], [1, 300]
    dense = DensePrefill("cpu", 8, 2, 64, torch.bfloat16, max_query_tokens=sum(q_lens))
    base = planner.plan_attention(2, 2, 4, max(q_lens), max(seq_lens), 64, 132, query_lens=q_lens)
    full = dense.plan(base, q_lens, seq_lens, softmax_scale=0.125)
    windowed = dense.plan(base, q_lens, seq_lens, softmax_scale=0.125, sliding_window=128)
    assert full.prefill.passes[0].wrapper is not windowed.prefill.passes[0].wrapper
    assert full.prefill.passes[0].wrapper["window_left"] == -1 and windowed.prefill.passes[0].wrapper["window_left"] == 127


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_attention_pairs_counts_the_masked_pairs(window, gen):
    q_lens = [int(x) for x in torch.randint(1, 30, (5,), generator=gen)]
    seq_lens = [q + int(x) for q, x in zip(q_lens, torch.randint(0, 50, (5,), generator=gen))]
    requests = range(1, 4)
    brute = sum(min(p + 1, window or p + 1) for b in requests for p in range(seq_lens[b] - q_lens[b], seq_lens[b]))
    assert attention_pairs(q_lens, seq_lens, requests, window) == brute


def test_a_step_too_small_for_the_dense_path_goes_to_the_prefill_kernel():
    # 32 q heads x D 128: 4 chunks of 512 from scratch (8.6e9 FLOPs) stay with the prefill kernel, one
    # 2048-token chunk over 12288 cached (1.1e11) takes the dense path; a window shrinks the work
    dense = DensePrefill("cpu", 32, 8, 128, torch.bfloat16, max_query_tokens=4096)
    dense.min_flops = DENSE_MIN_FLOPS
    for q_lens, seq_lens, window, planned in (([1, 512, 512, 512, 512], [900, 512, 512, 512, 512], None, False),
                                              ([1, 2048], [900, 14336], None, True),
                                              ([1, 2048], [900, 14336], 128, False)):
        base = planner.plan_attention(len(q_lens), 8, 4, max(q_lens), max(seq_lens), 128, 132, query_lens=q_lens)
        plan = dense.plan(base, q_lens, seq_lens, softmax_scale=0.1, sliding_window=window)
        assert (plan.prefill is not None) == planned, (q_lens, seq_lens, window)

