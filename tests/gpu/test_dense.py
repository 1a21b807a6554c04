"""The dense prefill path on the GPU: the CUDA dequantizer bit for bit against its CPU op, and whole mixed steps
(decode kernel + dequantized workspace + FlashInfer's FA3) against the fp64 reference: features, head
dims, groups, dtypes, layouts, KV chunks merged by log-sum-exp, lengths up to 20000, poisoned outputs,
and no host synchronization.  Needs a Hopper GPU and FlashInfer (skipped without them).

Each (dtype, head dim, window, soft cap) is one FA3 module FlashInfer builds on first use (about a
minute and a half each): the matrix keeps to dev/prebuild_flashinfer.py's VARIANTS, which a device
call builds in parallel first.
"""
from __future__ import annotations

import math

import pytest
import torch

from gpu_cases import LAYOUTS, fill_random, make_batch, make_cache, rel_l2
from kernel_checks import DEV, TOL
from nvfp4_backend import dense_prefill, ops, planner, reference
from nvfp4_backend.dense_prefill import DensePrefill

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_and_flashinfer():
    reason = dense_prefill.unavailable_reason(torch.device(DEV)) if torch.cuda.is_available() else "no GPU"
    if reason:
        pytest.skip(reason)


# ----------------------------------------------------------------------------- the dequantizer
@pytest.mark.parametrize("layout,page_size", [(layout, 16) for layout in LAYOUTS] + [("token_rows", 1), ("NHD", 64),
                                                                                    ("inline_nhd", 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequantize_kv_is_its_cpu_op_bit_for_bit(layout, page_size, dtype, gen):
    heads, head_dim = 3, 128
    pages = 3 * (30 * 16 // page_size + 1)  # three block-table rows of at least 300 positions each
    cache = make_cache(layout, pages, page_size, heads, head_dim, DEV)
    fill_random(cache, gen)
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(3, -1)
    capacity = table.shape[1] * page_size
    starts = [int(x) for x in torch.randint(0, capacity - 300, (3,), generator=gen)]
    lengths = [300, 1, 257]
    rows = [0, 300, 301, 558]
    segments = torch.tensor([rows, [2, 0, 1, 0], starts + [0]], dtype=torch.int32)
    kg, vg = torch.tensor(0.37), torch.tensor(2.5)
    outs = []
    for device in (DEV, "cpu"):
        c = cache if device == DEV else type(cache)(*[t.cpu() for t in cache.tensors()])
        k = torch.full((rows[-1] + 5, heads, head_dim), float("nan"), dtype=dtype, device=device)
        v = k.clone()
        torch.ops.nvfp4_backend.dequantize_kv(k[: rows[-1]], v[: rows[-1]], *c.tensors(), table.to(device),
                                              segments.to(device), kg.to(device), vg.to(device))
        outs.append((k.cpu(), v.cpu()))
    (k_gpu, v_gpu), (k_cpu, v_cpu) = outs
    assert sum(lengths) == rows[-1]
    assert torch.isnan(k_gpu[rows[-1]:]).all() and torch.isnan(v_gpu[rows[-1]:]).all(), "a row past the plan was written"
    assert torch.equal(k_gpu[:558], k_cpu[:558]) and torch.equal(v_gpu[:558], v_cpu[:558])


# ----------------------------------------------------------------------------- whole steps
def _mixed(gen, group, head_dim, longest=1500):
    """Decodes first (vLLM's order), then prefill chunks over cached prefixes and a prefill from scratch."""
    lens = [int(x) for x in torch.randint(2, longest, (4,), generator=gen)]
    q_lens = [1, 1, 1, lens[0], lens[1], max(lens[2] // 2, 2)]
    seq_lens = [777, 40, 3000, lens[0] + lens[3], lens[1], lens[2]]
    return seq_lens, q_lens


def _step(gen, *, layout="HND", head_dim=128, group=4, dtype=torch.bfloat16, seq_lens=None, q_lens=None, window=None,
          soft_cap=None, sinks=False, page_size=16, num_kv_heads=2, host_scale=True, workspace_bytes=None):
    """One mixed step through ops.paged_attention with a dense plan; returns (error, plan, dense runs)."""
    if seq_lens is None:
        seq_lens, q_lens = _mixed(gen, group, head_dim)
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, num_kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    hq = num_kv_heads * group
    batch = make_batch(seq_lens, q_lens, hq, head_dim, page_size, pages, dtype, gen, DEV)
    kg_value, vg = 0.37, torch.tensor(1.7, device=DEV)
    kg = kg_value if host_scale else torch.tensor(kg_value, device=DEV)
    sink_t = torch.randn(hq, generator=gen).to(DEV) if sinks else None
    scale = 1 / math.sqrt(head_dim)
    row_bytes = 2 * num_kv_heads * head_dim * dtype.itemsize
    dense = DensePrefill(DEV, hq, num_kv_heads, head_dim, dtype, max_query_tokens=sum(q_lens),
                         workspace_bytes=workspace_bytes or max(sum(seq_lens), 1) * row_bytes)
    runs = []
    real_run = dense.attention.run
    dense.attention.run = lambda *a: (runs.append(1), real_run(*a))
    base = planner.plan_attention(len(seq_lens), num_kv_heads, group, max(q_lens), max(seq_lens), head_dim,
                                  device=torch.device(DEV), query_lens=q_lens)
    plan = dense.plan(base, q_lens, seq_lens, softmax_scale=scale, sliding_window=window, logits_soft_cap=soft_cap)
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, scale,
                        max_query_len=max(q_lens), sliding_window=window, logits_soft_cap=soft_cap, sinks=sink_t,
                        out=out, plan=plan, seq_lens_cpu=batch.seq_lens.cpu(),
                        query_start_loc_cpu=batch.query_start_loc.cpu())
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        torch.tensor(kg_value, device=DEV), vg, scale, window, soft_cap, sink_t,
                                        dtype=torch.float64)
    assert not torch.isnan(out).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out, ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL}"
    return err, plan, len(runs)


# (dtype, head dim, window, soft cap): dev/prebuild_flashinfer.py's VARIANTS
@pytest.mark.parametrize("dtype,head_dim,group,window,soft_cap,sinks", [
    (torch.bfloat16, 128, 1, None, None, False),
    (torch.bfloat16, 128, 4, None, None, True),
    (torch.bfloat16, 128, 8, None, None, False),
    (torch.bfloat16, 128, 16, None, None, False),
    (torch.bfloat16, 128, 4, 4096, None, True),
    (torch.bfloat16, 128, 4, 37, None, False),
    (torch.bfloat16, 128, 4, None, 50.0, False),
    (torch.bfloat16, 64, 8, 128, None, True),       # gpt-oss
    (torch.bfloat16, 256, 2, 4096, 50.0, False),    # Gemma 2
    (torch.float16, 128, 1, None, None, False),
], ids=lambda v: {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(v, None) if isinstance(v, torch.dtype) else None)
@pytest.mark.parametrize("host_scale", [True, False], ids=["host_scale", "device_scale"])
def test_dense_matrix(dtype, head_dim, group, window, soft_cap, sinks, host_scale, gen):
    layout = LAYOUTS[(head_dim // 64 + group + int(sinks)) % len(LAYOUTS)]
    page_size = 1 if layout == "token_rows" else 16
    _, plan, runs = _step(gen, layout=layout, head_dim=head_dim, group=group, dtype=dtype, window=window,
                          soft_cap=soft_cap, sinks=sinks, page_size=page_size, host_scale=host_scale)
    # a K global scale only on the GPU: the prefill kernel serves the long requests (dense_prefill.run)
    assert plan.prefill is not None and runs == int(host_scale)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_layouts(layout, gen):
    page_size = 1 if layout == "token_rows" else 16
    _, plan, runs = _step(gen, layout=layout, page_size=page_size, num_kv_heads=3)
    assert runs == 1


@pytest.mark.parametrize("sinks", [False, True])
def test_dense_kv_chunks_merge_by_log_sum_exp(sinks, gen):
    """A workspace of 4400 rows (it must hold the step's 4202 query tokens): the causal pass, then prefix
    chunks (a chunk boundary inside a request, and a request that spans chunks), lengths up to 20000."""
    seq_lens, q_lens = [900, 20000, 2000, 6000, 300], [1, 1500, 2000, 700, 1]
    err, plan, runs = _step(gen, seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=1, sinks=sinks,
                            workspace_bytes=4400 * 2 * 128 * 2)
    assert plan.prefill is not None and len(plan.prefill.passes) > 3 and runs == len(plan.prefill.passes)


def test_dense_only_long_requests(gen):
    """Every request is a long one: the decode kernel is not launched, every row comes from the dense path."""
    _, plan, runs = _step(gen, seq_lens=[300, 1200, 40], q_lens=[300, 200, 17], layout="NHD")
    assert plan.prefill.covers_all and runs == 1


def _planned(gen, layout, **features):
    """A mixed step (8 q / 2 kv heads, D 128, bf16) and its dense plan at softmax scale 0.1."""
    seq_lens, q_lens = _mixed(gen, 4, 128)
    cache = make_cache(layout, 600, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 8, 128, 16, 600, torch.bfloat16, gen, DEV)
    dense = DensePrefill(DEV, 8, 2, 128, torch.bfloat16, max_query_tokens=sum(q_lens))
    base = planner.plan_attention(len(seq_lens), 2, 4, max(q_lens), max(seq_lens), 128, device=torch.device(DEV),
                                  query_lens=q_lens)
    return cache, batch, dense, dense.plan(base, q_lens, seq_lens, softmax_scale=0.1, **features), q_lens


def test_dense_no_host_synchronization(gen):
    """Planned with host lengths, host scales and out given: the call never synchronizes."""
    cache, batch, dense, plan, q_lens = _planned(gen, "HND", sliding_window=128)
    ws = plan.allocate_workspace(DEV)
    out = torch.empty_like(batch.q)
    sinks = torch.randn(8, generator=gen).to(DEV)
    kw = dict(max_query_len=max(q_lens), out=out, plan=plan, workspace=ws, sinks=sinks, sliding_window=128,
              seq_lens_cpu=batch.seq_lens.cpu(), query_start_loc_cpu=batch.query_start_loc.cpu())
    call = lambda: ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.4,
                                       1.3, 0.1, **kw)
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_captured_call_takes_the_prefill_kernel(gen):
    """A dense plan in a CUDA graph: the capture runs the prefill kernel (no FlashInfer call inside the
    graph), and the replay is the reference."""
    cache, batch, dense, plan, q_lens = _planned(gen, "NHD")
    ws = plan.allocate_workspace(DEV)
    out = torch.full_like(batch.q, float("nan"))
    runs = []
    real_run = dense.attention.run
    dense.attention.run = lambda *a: (runs.append(1), real_run(*a))
    step = lambda: ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 0.4,
                                       1.3, 0.1, max_query_len=max(q_lens), out=out, plan=plan, workspace=ws)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    assert not runs
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        torch.tensor(0.4), torch.tensor(1.3), 0.1, dtype=torch.float64)
    assert rel_l2(out, ref) < TOL


def test_dequantize_binding_rejects_bad_arguments(gen):
    cache = make_cache("NHD", 8, 16, 2, 128, DEV)
    table = torch.arange(8, dtype=torch.int32, device=DEV).view(2, 4)
    seg = torch.tensor([[0, 10], [0, 0], [0, 0]], dtype=torch.int32, device=DEV)
    one = torch.ones((), device=DEV)
    k = torch.full((10, 2, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="k_out and v_out must be contiguous"):
        torch.ops.nvfp4_backend.dequantize_kv(k[:, :1], k[:, :1], *cache.tensors(), table, seg, one, one)
    with pytest.raises(RuntimeError, match="segments must be"):
        torch.ops.nvfp4_backend.dequantize_kv(k, k.clone(), *cache.tensors(), table, seg.long(), one, one)
    with pytest.raises(RuntimeError, match="k_out must be float16 or bfloat16"):
        torch.ops.nvfp4_backend.dequantize_kv(k.float(), k.float(), *cache.tensors(), table, seg, one, one)
    torch.cuda.synchronize()
    assert torch.isnan(k).all(), "a refused call wrote its output"
