"""Public ops on CPU: ``write_kv`` and ``paged_attention`` (the reference path), their argument
checking, their custom-op registration and ``torch.compile``."""
from __future__ import annotations

import math

import pytest
import torch

from gpu_cases import misaligned
from nvfp4_backend import AttentionPlan, PagedKVCache, ops, planner, reference
from nvfp4_backend import format as fmt
from nvfp4_backend.capabilities import MAX_SPLITS

META = torch.device("meta")   # stands in for "some other device" on a CPU-only machine


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """Same values, each row padded by 4 elements: a head stride that is no multiple of 16 bytes."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] + 4, dtype=t.dtype, device=t.device)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, last-dim stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.fixture
def step(make_batch):
    """A small decode + spec-decode step over a 16-token-page cache, GQA 4, head_dim 64."""
    return make_batch((37, 5, 16), (1, 3, 2), page_size=16, num_kv_heads=2, group_size=4, head_dim=64,
                      q_dtype=torch.float16, k_global_scale=0.5, v_global_scale=2.0)


@pytest.fixture
def cache(step, poison_cache):
    c = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    poison_cache(c)
    return c


# ============================================================================ write_kv
def test_write_kv_writes_exactly_the_mapped_slots(step, cache, gen):
    before = [t.clone() for t in cache.tensors()]
    slots = step.slot_mapping.clone()
    skip = torch.rand(slots.shape, generator=gen) < 0.3
    slots[skip] = -1                                            # padding tokens: skipped
    ops.write_kv(step.key, step.value, slots.to(torch.int32), cache, step.k_global_scale, step.v_global_scale)
    kept = slots[~skip]
    page, off = kept // step.page_size, kept % step.page_size
    for t, old, x, g, data in ((cache.k_data, before[0], step.key, step.k_global_scale, True),
                               (cache.k_block_scales, before[1], step.key, step.k_global_scale, False),
                               (cache.v_data, before[2], step.value, step.v_global_scale, True),
                               (cache.v_block_scales, before[3], step.value, step.v_global_scale, False)):
        want = fmt.quantize(x[~skip], g)[0 if data else 1]
        assert torch.equal(t[page, off], want)
        untouched = torch.ones(t.shape[:2], dtype=torch.bool)
        untouched[page, off] = False
        assert torch.equal(t[untouched], old[untouched])


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_write_kv_global_scale_as_tensor_or_float(kv_dtype, make_batch, gen):
    step = make_batch((20,), (1,), page_size=16, num_kv_heads=2, group_size=1, head_dim=128, q_dtype=kv_dtype)
    a = PagedKVCache.allocate(step.num_pages, 16, 2, 128)
    b = PagedKVCache.allocate(step.num_pages, 16, 2, 128, layout="HND")
    ops.write_kv(step.key, step.value, step.slot_mapping, a, 0.3, 7.0)
    ops.write_kv(step.key, step.value, step.slot_mapping, b, torch.tensor(0.3), torch.tensor([7.0]))
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y)


# ============================================================================ paged_attention
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_is_the_reference_in_q_dtype(q_dtype, make_batch, gen):
    step = make_batch((70, 3, 33), (1, 2, 6), page_size=32, num_kv_heads=2, group_size=8, head_dim=128,
                      q_dtype=q_dtype)
    cache = PagedKVCache.allocate(step.num_pages, 32, 2, 128)
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    sinks = torch.randn(step.q.shape[1], generator=gen)
    args = (step.q, cache, step.block_table, step.seq_lens, step.query_start_loc, step.k_global_scale,
            step.v_global_scale, step.softmax_scale)
    kw = dict(sliding_window=40, logits_soft_cap=10.0, sinks=sinks)
    want = reference.paged_attention_ref(*args, **kw).to(q_dtype)
    out = torch.full_like(step.q, float("nan"))
    assert ops.paged_attention(*args, **kw, out=out) is out
    assert torch.equal(out, want)
    fresh = ops.paged_attention(*args, **kw)
    assert fresh.dtype == q_dtype and fresh.shape == step.q.shape and torch.equal(fresh, want)
    # an explicit plan with split-KV and its workspace changes nothing on the reference path
    plan = AttentionPlan(num_splits=4, workspace_bytes=4096)
    ws = plan.allocate_workspace("cpu")
    out2 = torch.full_like(step.q, float("nan"))
    ops.paged_attention(*args, **kw, out=out2, plan=plan, workspace=ws, max_query_len=step.max_query_len)
    assert torch.equal(out2, want)


def test_paged_attention_rejects_a_fused_plan_that_does_not_fit(step, cache):
    """A fused plan with more kv heads per block than the fused kernel takes (16) is a ValueError
    naming plan.heads_per_block, and out is not written."""
    args = _attn_args(step, cache)
    args["out"] = torch.full_like(step.q, float("nan"))
    with pytest.raises(ValueError, match="plan.heads_per_block 16 does not fit the fused kernel"):
        ops.paged_attention(**args, plan=AttentionPlan(1, 0, heads_per_block=16, fused=True))
    assert args["out"].isnan().all()


@pytest.mark.parametrize("layout, token_major", [("NHD", True), ("HND", False)])
def test_paged_attention_plans_for_the_cache_layout(layout, token_major, step, monkeypatch):
    """Without a plan, paged_attention plans for its cache's layout."""
    seen, plan = [], planner.plan_attention
    monkeypatch.setattr(planner, "plan_attention", lambda *a, **k: seen.append(k.get("token_major")) or plan(*a, **k))
    cache = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim, layout)
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    ops.paged_attention(**_attn_args(step, cache))
    assert seen == [token_major]



def test_paged_attention_rejects_a_plan_whose_heads_per_block_do_not_fit(step, cache):
    """A plan with two kv heads per block (plain decode) used for a step with spec-decode rows: a
    ValueError naming plan.heads_per_block, and out is not written."""
    args = _attn_args(step, cache)
    args["out"] = torch.full_like(step.q, float("nan"))
    with pytest.raises(ValueError, match="plan.heads_per_block must be 1, or 2 or 4"):
        ops.paged_attention(**args, plan=AttentionPlan(1, 0, heads_per_block=2))
    assert args["out"].isnan().all()


# ============================================================================ bad input
def _write_args(step, cache):
    return dict(key=step.key, value=step.value, slot_mapping=step.slot_mapping, cache=cache,
                k_global_scale=step.k_global_scale, v_global_scale=step.v_global_scale)


def _drop_scales(cache):
    broken = PagedKVCache(*cache.tensors())
    object.__setattr__(broken, "k_block_scales", None)          # as if a caller built it half-way
    return broken


def _meta_scale_cache(cache):
    broken = PagedKVCache(*cache.tensors())
    object.__setattr__(broken, "v_block_scales", cache.v_block_scales.to(META))
    return broken


_ODD_TENSOR_SCALE = ()

WRITE_BAD = {
    "key_not_tensor": (lambda a: a.update(key=a["key"].tolist()), TypeError, "key"),
    "key_fp32": (lambda a: a.update(key=a["key"].float()), TypeError, "key"),
    "key_int": (lambda a: a.update(key=a["key"].to(torch.int16)), TypeError, "key"),
    "value_dtype_differs": (lambda a: a.update(value=a["value"].bfloat16()), TypeError, "value"),
    "key_2d": (lambda a: a.update(key=a["key"].flatten(1)), ValueError, "key"),
    "key_heads": (lambda a: a.update(key=a["key"][:, :1]), ValueError, "key"),
    "key_head_dim": (lambda a: a.update(key=a["key"][..., :48]), ValueError, "key"),
    "key_head_dim_not_16": (lambda a: a.update(key=a["key"][..., :40]), ValueError, "key"),
    "value_tokens": (lambda a: a.update(value=a["value"][:-1]), ValueError, "value"),
    "key_stride": (lambda a: a.update(key=noncontig(a["key"])), ValueError, "key"),
    "value_stride": (lambda a: a.update(value=noncontig(a["value"])), ValueError, "value"),
    "slots_float": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "slot_mapping"),
    "slots_int16": (lambda a: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)), TypeError, "slot_mapping"),
    "slots_2d": (lambda a: a.update(slot_mapping=a["slot_mapping"][:, None]), ValueError, "slot_mapping"),
    "slots_length": (lambda a: a.update(slot_mapping=a["slot_mapping"][1:]), ValueError, "slot_mapping"),
    "slot_past_end": (lambda a: a["slot_mapping"].__setitem__(-1, a["cache"].num_slots), ValueError, "slot_mapping"),
    "slot_far_past_end": (lambda a: a["slot_mapping"].__setitem__(0, 10**9), ValueError, "slot_mapping"),
    "key_meta": (lambda a: a.update(key=a["key"].to(META)), ValueError, "key"),
    "value_meta": (lambda a: a.update(value=a["value"].to(META)), ValueError, "value"),
    "slots_meta": (lambda a: a.update(slot_mapping=a["slot_mapping"].to(META)), ValueError, "slot_mapping"),
    "k_scale_meta": (lambda a: a.update(k_global_scale=torch.tensor(1.0, device=META)), ValueError, "k_global_scale"),
    "cache_scales_meta": (lambda a: a.update(cache=_meta_scale_cache(a["cache"])), ValueError, "v_block_scales"),
    "cache_not_cache": (lambda a: a.update(cache=a["cache"].tensors()), TypeError, "cache"),
    "cache_scales_missing": (lambda a: a.update(cache=_drop_scales(a["cache"])), TypeError, "k_block_scales"),
    "k_scale_none": (lambda a: a.update(k_global_scale=None), TypeError, "k_global_scale"),
    "v_scale_none": (lambda a: a.update(v_global_scale=None), TypeError, "v_global_scale"),
    "k_scale_zero": (lambda a: a.update(k_global_scale=0.0), ValueError, "k_global_scale"),
    "k_scale_negative": (lambda a: a.update(k_global_scale=-1.0), ValueError, "k_global_scale"),
    "v_scale_nan": (lambda a: a.update(v_global_scale=math.nan), ValueError, "v_global_scale"),
    "v_scale_inf": (lambda a: a.update(v_global_scale=math.inf), ValueError, "v_global_scale"),
    "k_scale_fp64_tensor": (lambda a: a.update(k_global_scale=torch.tensor(1.0, dtype=torch.float64)), TypeError,
                            "k_global_scale"),
    "v_scale_two_values": (lambda a: a.update(v_global_scale=torch.ones(2)), ValueError, "v_global_scale"),
    "k_scale_tensor_zero": pytest.param(lambda a: a.update(k_global_scale=torch.tensor(0.0)), ValueError,
                                        "k_global_scale", marks=_ODD_TENSOR_SCALE),
    "v_scale_tensor_negative": pytest.param(lambda a: a.update(v_global_scale=torch.tensor([-2.0])), ValueError,
                                            "v_global_scale", marks=_ODD_TENSOR_SCALE),
}


def _case(v):
    return v if isinstance(v, type(pytest.param(None))) else pytest.param(*v)


@pytest.mark.parametrize("mutate, exc, name", [_case(v) for v in WRITE_BAD.values()], ids=list(WRITE_BAD))
def test_write_kv_rejects_bad_input(mutate, exc, name, step, cache):
    before = [t.clone() for t in cache.tensors()]
    args = _write_args(step, cache)
    mutate(args)
    with pytest.raises(exc, match=name):
        ops.write_kv(**args)
    for t, old in zip(cache.tensors(), before):
        assert torch.equal(t, old), "the cache changed although the call was rejected"


def _attn_args(step, cache):
    return dict(q=step.q, cache=cache, block_table=step.block_table, seq_lens=step.seq_lens,
                query_start_loc=step.query_start_loc, k_global_scale=step.k_global_scale,
                v_global_scale=step.v_global_scale, softmax_scale=step.softmax_scale)


_OUT_OF_RANGE_READS = ()

ATTN_BAD = {
    "q_fp32": (lambda a: a.update(q=a["q"].float()), TypeError, "q"),
    "q_not_tensor": (lambda a: a.update(q=a["q"].numpy()), TypeError, "q"),
    "q_2d": (lambda a: a.update(q=a["q"].flatten(1)), ValueError, "q"),
    "q_head_dim": (lambda a: a.update(q=a["q"][..., :32]), ValueError, "q"),
    "q_heads_not_multiple": (lambda a: a.update(q=a["q"][:, :7]), ValueError, "q"),
    "q_stride": (lambda a: a.update(q=noncontig(a["q"])), ValueError, "q"),
    "q_meta": (lambda a: a.update(q=a["q"].to(META)), ValueError, "q"),
    "q_misaligned": (lambda a: a.update(q=misaligned(a["q"])), ValueError, "q rows must be 16-byte aligned"),
    "q_head_stride": (lambda a: a.update(q=wide_rows(a["q"])), ValueError, r"q rows .*stride\(1\)"),
    "block_table_int64": (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    "block_table_1d": (lambda a: a.update(block_table=a["block_table"][0]), ValueError, "block_table"),
    "block_table_stride": (lambda a: a.update(block_table=noncontig(a["block_table"])), ValueError, "block_table"),
    "block_table_rows": (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table"),
    "block_table_meta": (lambda a: a.update(block_table=a["block_table"].to(META)), ValueError, "block_table"),
    "seq_lens_int64": (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    "seq_lens_2d": (lambda a: a.update(seq_lens=a["seq_lens"][None]), ValueError, "seq_lens"),
    "seq_lens_meta": (lambda a: a.update(seq_lens=a["seq_lens"].to(META)), ValueError, "seq_lens"),
    "qsl_length": (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), ValueError, "query_start_loc"),
    "qsl_int64": (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), TypeError, "query_start_loc"),
    "softmax_scale_zero": (lambda a: a.update(softmax_scale=0.0), ValueError, "softmax_scale"),
    "softmax_scale_negative": (lambda a: a.update(softmax_scale=-0.1), ValueError, "softmax_scale"),
    "softmax_scale_nan": (lambda a: a.update(softmax_scale=math.nan), ValueError, "softmax_scale"),
    "softmax_scale_inf": (lambda a: a.update(softmax_scale=math.inf), ValueError, "softmax_scale"),
    "softmax_scale_none": (lambda a: a.update(softmax_scale=None), (TypeError, ValueError), "softmax_scale"),
    "softmax_scale_str": (lambda a: a.update(softmax_scale="0.125"), (TypeError, ValueError), "softmax_scale"),
    "sliding_window_zero": (lambda a: a.update(sliding_window=0), ValueError, "sliding_window"),
    "sliding_window_negative": (lambda a: a.update(sliding_window=-4), ValueError, "sliding_window"),
    "soft_cap_negative": (lambda a: a.update(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    "sinks_length": (lambda a: a.update(sinks=torch.zeros(a["q"].shape[1] - 1)), ValueError, "sinks"),
    "sinks_per_kv_head": (lambda a: a.update(sinks=torch.zeros(a["cache"].num_kv_heads)), ValueError, "sinks"),
    "sinks_fp16": (lambda a: a.update(sinks=torch.zeros(a["q"].shape[1], dtype=torch.float16)), TypeError, "sinks"),
    "sinks_2d": (lambda a: a.update(sinks=torch.zeros(1, a["q"].shape[1])), ValueError, "sinks"),
    "sinks_meta": (lambda a: a.update(sinks=torch.zeros(a["q"].shape[1], device=META)), ValueError, "sinks"),
    "k_scale_none": (lambda a: a.update(k_global_scale=None), TypeError, "k_global_scale"),
    "v_scale_zero": (lambda a: a.update(v_global_scale=0.0), ValueError, "v_global_scale"),
    "v_scale_meta": (lambda a: a.update(v_global_scale=torch.tensor(1.0, device=META)), ValueError, "v_global_scale"),
    "cache_scales_missing": (lambda a: a.update(cache=_drop_scales(a["cache"])), TypeError, "k_block_scales"),
    "out_dtype": (lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.bfloat16)), TypeError, "out"),
    "out_shape": (lambda a: a.update(out=torch.empty_like(a["q"])[:-1]), ValueError, "out"),
    "out_meta": (lambda a: a.update(out=torch.empty_like(a["q"], device=META)), ValueError, "out"),
    "out_misaligned": (lambda a: a.update(out=misaligned(a["out"])), ValueError, "out rows must be 16-byte aligned"),
    "workspace_small": (lambda a: a.update(plan=AttentionPlan(2, 1024),
                                           workspace=torch.empty(16, dtype=torch.uint8)), ValueError, "workspace"),
    "plan_no_splits": (lambda a: a.update(plan=AttentionPlan(0, 0)), ValueError, "num_splits"),
    "plan_too_many_splits": (lambda a: a.update(plan=AttentionPlan(MAX_SPLITS + 1, 1 << 20)), ValueError,
                             "num_splits"),
    "workspace_misaligned": (lambda a: a.update(plan=AttentionPlan(2, 1024),
                                                workspace=torch.empty(1040, dtype=torch.uint8)[4:]), ValueError,
                             "workspace"),
    "seq_len_beyond_block_table": pytest.param(
        lambda a: a["seq_lens"].__setitem__(1, a["block_table"].shape[1] * a["cache"].page_size + 1),
        ValueError, "seq_lens", marks=_OUT_OF_RANGE_READS),
    "block_table_page_out_of_range": pytest.param(
        lambda a: a["block_table"].__setitem__((0, 0), a["cache"].num_pages), ValueError, "block_table",
        marks=_OUT_OF_RANGE_READS),
    "seq_len_shorter_than_queries": (lambda a: a["seq_lens"].__setitem__(0, 0), ValueError, r"seq_lens\[0\] = 0"),
    "qsl_past_q_tokens": pytest.param(
        lambda a: a["query_start_loc"].__setitem__(-1, a["q"].shape[0] + 2), ValueError, "query_start_loc",
        marks=_OUT_OF_RANGE_READS),
    "sliding_window_float": pytest.param(lambda a: a.update(sliding_window=2.5), (TypeError, ValueError),
                                         "sliding_window"),
    "workspace_meta": pytest.param(
        lambda a: a.update(workspace=torch.empty(1 << 16, dtype=torch.uint8, device=META)), ValueError, "workspace",
),
    "soft_cap_nan": pytest.param(lambda a: a.update(logits_soft_cap=math.nan), ValueError, "logits_soft_cap",
                         ),
}


@pytest.mark.parametrize("mutate, exc, name", [_case(v) for v in ATTN_BAD.values()], ids=list(ATTN_BAD))
def test_paged_attention_rejects_bad_input(mutate, exc, name, step, cache):
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    before = [t.clone() for t in cache.tensors()]
    args = _attn_args(step, cache)
    args["block_table"], args["seq_lens"] = args["block_table"].clone(), args["seq_lens"].clone()
    args["query_start_loc"] = args["query_start_loc"].clone()
    args["out"] = torch.full_like(step.q, float("nan"))
    poisoned = args["out"]
    mutate(args)
    with pytest.raises(exc, match=name):
        ops.paged_attention(**args)
    for t, old in zip(cache.tensors(), before):
        assert torch.equal(t, old)
    assert poisoned.isnan().all(), "out was written although the call was rejected"


def test_bad_input_baseline_succeeds(step, cache):
    """The unmutated arguments of the two tables above are valid (so each rejection is the mutation's)."""
    ops.write_kv(**_write_args(step, cache))
    out = ops.paged_attention(**_attn_args(step, cache), sliding_window=4, logits_soft_cap=5.0,
                              sinks=torch.zeros(step.q.shape[1]))
    assert torch.isfinite(out).all()


# ============================================================================ custom-op registration
def test_opcheck_write_kv(step, cache):
    g = torch.tensor(step.k_global_scale), torch.tensor(step.v_global_scale)
    torch.library.opcheck(torch.ops.nvfp4_backend.write_kv,
                          (step.key, step.value, step.slot_mapping, *cache.tensors(), *g))


def test_opcheck_paged_attention(step, cache, gen):
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    plan = planner.plan_attention(3, step.num_kv_heads, 4, step.max_query_len, int(step.seq_lens.max()), step.head_dim)
    out = torch.full_like(step.q, float("nan"))
    sinks = torch.randn(step.q.shape[1], generator=gen)
    torch.library.opcheck(torch.ops.nvfp4_backend.paged_attention,
                          (out, step.q, *cache.tensors(), step.block_table, step.seq_lens, step.query_start_loc,
                           torch.tensor(step.k_global_scale), torch.tensor(step.v_global_scale),
                           step.softmax_scale, 9, 20.0, sinks, step.max_query_len, plan.num_splits,
                           plan.allocate_workspace("cpu")))


# ============================================================================ torch.compile
def _compiled_step(step, cache_a, cache_b, sinks, write: str | None):
    kg, vg = torch.tensor(step.k_global_scale), torch.tensor(step.v_global_scale)
    plan = planner.plan_attention(3, step.num_kv_heads, 4, step.max_query_len, int(step.seq_lens.max()), step.head_dim)
    ws = plan.allocate_workspace("cpu")
    max_query_len = step.max_query_len          # host-known, like every engine's metadata builder

    def fn(cache, key, value, q):
        if write == "wrapper":
            ops.write_kv(key, value, step.slot_mapping, cache, kg, vg)
        elif write == "op":                     # the registered op itself: mutation through the fake
            torch.ops.nvfp4_backend.write_kv(key, value, step.slot_mapping, *cache.tensors(), kg, vg)
        return ops.paged_attention(q, cache, step.block_table, step.seq_lens, step.query_start_loc, kg, vg,
                                   step.softmax_scale, max_query_len=max_query_len, sliding_window=12,
                                   logits_soft_cap=25.0, sinks=sinks, plan=plan, workspace=ws)

    torch._dynamo.reset()
    eager = fn(cache_a, step.key, step.value, step.q)
    compiled = torch.compile(fn, fullgraph=True)(cache_b, step.key, step.value, step.q)
    return eager, compiled


def test_compile_paged_attention_matches_eager(step, gen):
    a = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    ops.write_kv(step.key, step.value, step.slot_mapping, a, step.k_global_scale, step.v_global_scale)
    sinks = torch.randn(step.q.shape[1], generator=gen)
    eager, compiled = _compiled_step(step, a, a, sinks, write=None)
    assert torch.isfinite(eager).all() and torch.equal(compiled, eager)


def test_compile_write_kv_and_attention_matches_eager(step, gen):
    a = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    b = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    sinks = torch.randn(step.q.shape[1], generator=gen)
    eager, compiled = _compiled_step(step, a, b, sinks, write="wrapper")
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y)
    assert torch.isfinite(eager).all() and torch.equal(compiled, eager)


def test_compile_write_op_and_attention_matches_eager(step, gen, poison_cache):
    """What the test above checks, with the custom op called directly for the write."""
    a = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    b = PagedKVCache.allocate(step.num_pages, step.page_size, step.num_kv_heads, step.head_dim)
    for x, y in zip(poison_cache(a), b.tensors()):
        y.copy_(x)
    sinks = torch.randn(step.q.shape[1], generator=gen)
    eager, compiled = _compiled_step(step, a, b, sinks, write="op")
    for x, y in zip(a.tensors(), b.tensors()):
        assert torch.equal(x, y)
    assert torch.isfinite(eager).all() and torch.equal(compiled, eager)


def test_host_lengths_replace_device_reads(make_batch, monkeypatch):
    """With the lengths on the host, the plan's bounds come from them (no device read) and the
    output is the same; bad host tensors are refused by name."""
    step = make_batch((40, 9, 23), (11, 9, 1), page_size=16, num_kv_heads=2, group_size=4, head_dim=64)
    cache = PagedKVCache.allocate(step.num_pages, 16, 2, 64)
    ops.write_kv(step.key, step.value, step.slot_mapping, cache, step.k_global_scale, step.v_global_scale)
    args = (step.q, cache, step.block_table, step.seq_lens, step.query_start_loc, step.k_global_scale,
            step.v_global_scale, step.softmax_scale)
    want = ops.paged_attention(*args)
    planned = []
    monkeypatch.setattr(planner, "plan_attention", lambda *a, **k: planned.append(a) or planner.AttentionPlan(1, 0))
    got = ops.paged_attention(*args, seq_lens_cpu=step.seq_lens.clone(), query_start_loc_cpu=step.query_start_loc.clone())
    assert torch.equal(got, want)
    assert planned[0][3] == 11 and planned[0][4] == 40  # max query len and max seq len from the host copies
    with pytest.raises(ValueError, match="seq_lens_cpu must have 3 entries"):
        ops.paged_attention(*args, seq_lens_cpu=step.seq_lens[:2].clone())
    with pytest.raises(TypeError, match="query_start_loc_cpu must have dtype"):
        ops.paged_attention(*args, query_start_loc_cpu=step.query_start_loc.float())
