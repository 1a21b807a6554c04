"""The extend path: the prefill kernel (queries past the decode kernel's rows) vs the fp64 reference (skipped without
a GPU): every head dim, group, layout, dtype, feature and KV mode, ragged batches mixing decodes and
prefill chunks, pages in random order, outputs poisoned with NaN (rows of no request must keep it).
"""
from __future__ import annotations

import math

import pytest
import torch

from gpu_cases import LAYOUTS, fill_random, make_batch, make_cache, rel_l2
from kernel_checks import DEV, TOL, scales
from nvfp4_backend import capabilities, jit, ops, planner, reference
from nvfp4_backend import format as fmt
from nvfp4_backend.layout import PagedKVCache
from nvfp4_backend.modes import KVMode

pytestmark = pytest.mark.gpu


def _run(gen, layout, head_dim, group, dtype, seq_lens, q_lens, page_size=16, num_kv_heads=2, window=None,
         soft_cap=None, sinks=False, mode=KVMode(), host_lengths=False):
    """One ragged batch through ops.paged_attention against the reference; returns the error."""
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, num_kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    cache = PagedKVCache(*cache.tensors(), mode=mode)
    batch = make_batch(seq_lens, q_lens, num_kv_heads * group, head_dim, page_size, pages, dtype, gen, DEV)
    kg, vg = scales(gen)
    sink_t = torch.randn(num_kv_heads * group, generator=gen).to(DEV) if sinks else None
    # rows of no request before and after the batch's (query_start_loc starts past 0)
    stray = lambda n: torch.randn(n, *batch.q.shape[1:], generator=gen).to(dtype).to(DEV)
    q = torch.cat([stray(5), batch.q, stray(3)])
    qsl = batch.query_start_loc + 5
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    extra = dict(seq_lens_cpu=batch.seq_lens.cpu(), query_start_loc_cpu=qsl.cpu()) if host_lengths else {}
    ops.paged_attention(q, cache, batch.block_table, batch.seq_lens, qsl, kg, vg, scale,
                        max_query_len=batch.max_query_len, sliding_window=window, logits_soft_cap=soft_cap,
                        sinks=sink_t, out=out, **extra)
    rotated = mode.rotation == "hadamard"
    q_in = fmt.hadamard_transform(batch.q.double()) if rotated else batch.q
    ref = reference.paged_attention_ref(q_in, PagedKVCache(*cache.tensors()), batch.block_table, batch.seq_lens,
                                        batch.query_start_loc, kg, vg, scale, window, soft_cap, sink_t,
                                        dtype=torch.float64)
    if rotated:
        ref = fmt.hadamard_transform(ref)
    rows = slice(5, 5 + batch.q.shape[0])
    assert torch.isnan(out[:5]).all() and torch.isnan(out[rows.stop:]).all(), "a row of no request was written"
    assert not torch.isnan(out[rows]).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out[rows], ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL}"
    return err


def _ragged(gen, group, head_dim, longest=700):
    """A batch mixing a prefill from scratch, chunked prefills over a cached prefix, a request of
    exactly the decode kernel's longest query, one just past it, decodes and an idle request."""
    share = capabilities.decode_query_len(group, head_dim)
    lens = [int(x) for x in torch.randint(1, longest, (3,), generator=gen)]
    q_lens = [lens[0], lens[1], share, share + 1, 1, 0, max(lens[2] // 3, 1)]
    seq_lens = [lens[0], lens[1] + int(torch.randint(0, 900, (), generator=gen)), share + 50, share + 1, 777, 40,
                lens[2] + q_lens[-1]]
    return seq_lens, q_lens


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_matrix(head_dim, group, dtype, gen):
    layout = LAYOUTS[(head_dim // 64 + group + (dtype == torch.float16)) % len(LAYOUTS)]
    page_size = 1 if layout == "token_rows" else 16
    seq_lens, q_lens = _ragged(gen, group, head_dim)
    _run(gen, layout, head_dim, group, dtype, seq_lens, q_lens, page_size=page_size)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 12, 16, 64])
def test_prefill_layouts_and_page_sizes(layout, page_size, gen):
    """Every layout and page sizes that are not powers of two (the decode kernel's shifts cannot
    serve those: the prefill kernel then takes every request, decodes included)."""
    seq_lens, q_lens = _ragged(gen, 4, 128)
    _run(gen, layout, 128, 4, torch.bfloat16, seq_lens, q_lens, page_size=page_size, num_kv_heads=3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads,page_size", [(1, 1), (3, 3), (1, 5)])
def test_prefill_inline_pages_of_4_byte_rows(head_dim, num_kv_heads, page_size, gen):
    """vLLM inline pages whose page_size x kv heads is odd: V's rows start 4 or 8 bytes past a
    16-byte boundary, so the kernel copies 4-byte pieces."""
    seq_lens, q_lens = _ragged(gen, 2, head_dim, longest=300)
    _run(gen, "inline_nhd", head_dim, 2, torch.float16, seq_lens, q_lens, page_size=page_size,
         num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("window", [None, 1, 37, 128, 4096])
@pytest.mark.parametrize("soft_cap", [None, 50.0])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_features(window, soft_cap, sinks, dtype, gen):
    layout = LAYOUTS[((window or 0) + int(sinks) + int(soft_cap or 0)) % len(LAYOUTS)]
    page_size = 1 if layout == "token_rows" else 16
    seq_lens, q_lens = _ragged(gen, 8, 64, longest=1000)
    _run(gen, layout, 64, 8, dtype, seq_lens, q_lens, page_size=page_size, window=window, soft_cap=soft_cap,
         sinks=sinks)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mode", [KVMode("6or4"), KVMode(rotation="hadamard"), KVMode("6or4", "hadamard")])
def test_prefill_kv_modes(head_dim, mode, gen):
    """The Hadamard modes: q rotated in the kernel, the output rotated back (the reference takes
    q H and rotates its output)."""
    seq_lens, q_lens = _ragged(gen, 4, head_dim, longest=400)
    _run(gen, "HND", head_dim, 4, torch.bfloat16, seq_lens, q_lens, mode=mode, sinks=True, window=100)


@pytest.mark.parametrize("layout", ["NHD", "token_rows"])
def test_prefill_only_long_requests_with_host_lengths(layout, gen):
    """Host lengths showing no request of decode length: the decode kernel is not launched, and every
    row still comes from the prefill kernel."""
    page_size = 1 if layout == "token_rows" else 16
    _run(gen, layout, 128, 4, torch.float16, [300, 1200, 40], [300, 200, 17], page_size=page_size, host_lengths=True)


def test_prefill_long_ragged(gen):
    """Lengths up to 20000: a long chunk over a long prefix next to short requests."""
    _run(gen, "NHD", 128, 2, torch.bfloat16, [20000, 9000, 300, 5], [1500, 9000, 300, 5], num_kv_heads=1,
         host_lengths=True)


@pytest.mark.parametrize("magnitude, softmax_scale", [(1e6, 1e-7), (1e-36, 1e34), (1e-20, 1.0)])
def test_prefill_bf16_queries_far_from_fp16_range(magnitude, softmax_scale, gen):
    """Rows are scaled by a power of two into fp16's range (at most 2^127), so bf16 queries of 1e6 and
    of 1e-36 stay finite and accurate, and queries of 1e-20 give the near-uniform softmax."""
    seq_lens, q_lens = [300, 200], [300, 150]
    cache = make_cache("NHD", 40, 16, 1, 64, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 2, 64, 16, 40, torch.bfloat16, gen, DEV)
    q = (batch.q.double() * magnitude).to(torch.bfloat16)
    out = ops.paged_attention(q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1.0, 1.0,
                              softmax_scale, max_query_len=300)
    ref = reference.paged_attention_ref(q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        torch.tensor(1.0), torch.tensor(1.0), softmax_scale, dtype=torch.float64)
    assert torch.isfinite(out).all() and rel_l2(out, ref) < TOL


@pytest.mark.parametrize("num_splits, heads_per_block, fused", [(1, 1, False), (3, 1, False), (1, 2, True),
                                                                  (4, 1, True)])
def test_decode_kernel_leaves_longer_requests_alone(num_splits, heads_per_block, fused, gen):
    """The decode kernel alone (the op with a decode query length of 1 and no prefill launch): rows of
    a request longer than its share stay as they were, split or not, so the prefill kernel running
    beside it owns them; the decodes' rows match the reference."""
    seq_lens, q_lens = [900, 40, 1300, 5], [1, 33, 1, 5]
    cache = make_cache("HND", 200, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 8, 128, 16, 200, torch.bfloat16, gen, DEV)
    kg, vg = scales(gen)
    # the splits' partial rows: batch x kv heads x splits x max_rows (1 x group) x (D + 2) fp32
    ws = torch.empty(4 * 2 * num_splits * 4 * 130 * 4, dtype=torch.uint8, device=DEV)
    out = torch.full_like(batch.q, float("nan"))
    torch.ops.nvfp4_backend.paged_attention(
        out, batch.q, *cache.tensors(), batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1, 0,
        0.0, None, 1, num_splits, ws, "none", heads_per_block, fused, 1)
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, 0.1, dtype=torch.float64)
    decodes = torch.tensor([0, 34], device=DEV)
    assert torch.isnan(out[1:34]).all() and torch.isnan(out[35:]).all(), "a longer request's rows were written"
    assert rel_l2(out[decodes], ref[decodes]) <= TOL


def _mixed_step(gen, layout="NHD"):
    """A vLLM-shaped mixed batch: decodes first, then prefill chunks (ragged)."""
    seq_lens = [900, 1300, 77, 2, 600, 1500]
    q_lens = [1, 1, 1, 2, 600, 300]
    cache = make_cache(layout, 400, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 8, 128, 16, 400, torch.bfloat16, gen, DEV)
    return cache, batch


@pytest.mark.parametrize("planned_by_lengths", [False, True])
def test_mixed_batch_graph_replays_bit_equal_with_new_lengths(planned_by_lengths, gen):
    """Decodes and prefill chunks in one call, captured in one CUDA graph: the replay equals eager,
    bit for bit, also after new lengths and new cache contents are written into the same buffers
    (planned from the step's query lengths, the decode kernel serves up to 2 tokens, the prefill
    kernel the rest)."""
    cache, batch = _mixed_step(gen)
    kg, vg = scales(gen)
    max_q, max_len = 600, 1600
    lens = dict(query_lens=[1, 1, 1, 2, 600, 300]) if planned_by_lengths else {}
    plan = planner.plan_attention(6, 2, 4, max_q, max_len, 128, device=torch.device(DEV), **lens)
    assert plan.decode_query_len == (2 if planned_by_lengths else None)
    ws = plan.allocate_workspace(DEV)
    out = torch.empty_like(batch.q)

    def step():
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1,
                            sliding_window=700, max_query_len=max_q, out=out, plan=plan, workspace=ws)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    for round_ in range(3):
        if round_:  # new lengths (same shapes: the same query rows, regrouped) and new cache bytes
            # (every request within the pages its block-table row holds: 900, 1300, 77, 2, 600, 1500)
            new_q = torch.tensor([1, 1, 1, 2, 450, 450], dtype=torch.int32)
            batch.query_start_loc.copy_(torch.cat([torch.zeros(1, dtype=torch.int32), new_q.cumsum(0)]).to(DEV))
            batch.seq_lens.copy_(torch.tensor([900 - round_, 1000, 70, 2, 500, 1500], dtype=torch.int32).to(DEV))
            fill_random(cache, gen)
            batch.q.copy_(torch.randn(batch.q.shape, generator=gen).to(batch.q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out), f"round {round_}: graph replay differs from eager"
        ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                            kg, vg, 0.1, 700, dtype=torch.float64)
        assert rel_l2(out, ref) < TOL


def test_no_host_synchronization(gen):
    """With max_query_len, a plan, a workspace and out given, a mixed call never synchronizes."""
    cache, batch = _mixed_step(gen)
    kg, vg = scales(gen)
    plan = planner.plan_attention(6, 2, 4, 600, 1500, 128, device=torch.device(DEV))
    ws = plan.allocate_workspace(DEV)
    out = torch.empty_like(batch.q)
    sinks = torch.randn(8, generator=gen).to(DEV)
    kw = dict(max_query_len=600, out=out, plan=plan, workspace=ws, sinks=sinks, logits_soft_cap=30.0,
              sliding_window=128)
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_prefill_binding_rejects_bad_arguments(gen):
    cache, batch = _mixed_step(gen)
    kernels = jit.load(torch.device(DEV))
    kg, vg = scales(gen)
    out = torch.full_like(batch.q, float("nan"))
    args = (batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1, 0, 0.0, None, 1, "none")
    with pytest.raises(RuntimeError, match="paged_prefill takes head_dim 64, 128 or 256"):
        q = torch.zeros(4, 8, 96, dtype=torch.bfloat16, device=DEV)
        kernels.paged_prefill(q.clone(), q, *cache.tensors(), *args)
    with pytest.raises(RuntimeError, match="q must be float16 or bfloat16"):
        kernels.paged_prefill(out.float(), batch.q.float(), *cache.tensors(), *args)
    with pytest.raises(RuntimeError, match="rotation must be"):
        kernels.paged_prefill(out, batch.q, *cache.tensors(), *args[:-1], "spin")
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "a refused call wrote its output"
