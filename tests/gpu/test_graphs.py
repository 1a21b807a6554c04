"""CUDA graphs, streams and devices: capture and replay, determinism, the tensors' device and current
stream (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import fill_random, make_batch, make_cache, rel_l2
from kernel_checks import DEV, TOL, scales
from nvfp4_backend import jit, ops, planner, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads_per_block,fused", [(1, False), (2, False), (2, True)])
def test_cuda_graph_replay_and_determinism(heads_per_block, fused, gen):
    seq_lens, q_lens = [500, 1200, 77], [1, 1, 1]
    cache = make_cache("HND", 200, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 8, 128, 16, 200, torch.bfloat16, gen, DEV)
    kg, vg = scales(gen)
    plan = planner.plan_attention(3, 2, 4, 1, 1200, 128, heads_per_block=heads_per_block, fused=fused)
    assert plan.num_splits > 1 and plan.fused == fused
    ws = plan.allocate_workspace(DEV)
    out = torch.empty_like(batch.q)

    def step():
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1,
                            max_query_len=1, out=out, plan=plan, workspace=ws)

    step()
    eager = out.clone()
    step()
    assert torch.equal(out, eager), "two identical calls differ (non-deterministic merge)"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm up on the capture stream
        graph = torch.cuda.CUDAGraph()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager"
    q2 = torch.randn_like(batch.q)
    batch.q.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    step()
    assert torch.equal(out, out.clone())


def _devices():
    return [pytest.param(i, marks=pytest.mark.skipif(torch.cuda.device_count() <= i, reason=f"needs {i + 1} GPUs"))
            for i in (0, 1)]


@pytest.mark.parametrize("index", _devices())
def test_runs_on_the_tensors_device_and_current_stream(index, gen):
    """Inputs on GPU ``index`` while the current device is GPU 0, on a side stream of GPU
    ``index`` whose queue is busy (a sleep) before the query is written: the ops must run on that
    stream (else they read the old query or race the writer), and a CUDA graph captured there
    must replay correctly."""
    dev = torch.device("cuda", index)
    torch.cuda.set_device(0)
    seq_lens, hkv, group, d, ps = [300, 1200, 77], 2, 4, 128, 16
    cache = make_cache("HND", 200, ps, hkv, d, dev)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, [1, 1, 1], hkv * group, d, ps, 200, torch.bfloat16, gen, dev)
    kg, vg = (torch.tensor(x, device=dev) for x in (0.5, 0.25))
    new_q = torch.randn(batch.q.shape, generator=gen).to(torch.bfloat16).to(dev)
    key = torch.randn(3, hkv, d, generator=gen).to(torch.bfloat16).to(dev)
    slots = torch.tensor([int(batch.block_table[b, (s - 1) // ps]) * ps + (s - 1) % ps
                          for b, s in enumerate(seq_lens)], device=dev)
    plan = planner.plan_attention(3, hkv, group, 1, 1200, d)
    ws = plan.allocate_workspace(dev)
    out = torch.full_like(batch.q, float("nan"))
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # the inputs above were made on the default stream
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work ahead of the writes below
        batch.q.copy_(new_q)
        ops.write_kv(key, key, slots, cache, kg, vg)
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1,
                            max_query_len=1, out=out, plan=plan, workspace=ws)
    stream.synchronize()
    ref = reference.paged_attention_ref(new_q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg,
                                        vg, 0.1, dtype=torch.float64)
    assert rel_l2(out.float(), ref) < TOL
    # the prefill kernel (64 new rows of request 1) on that stream: no host read in between, so rows
    # doubled behind the sleep must be the ones it reads
    ext_q = torch.randn(64, hkv * group, d, generator=gen).to(torch.bfloat16).to(dev)
    ext_qsl = torch.tensor([0, 0, 64, 64], dtype=torch.int32, device=dev)
    ext_out = torch.full_like(ext_q, float("nan"))
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        ext_q.mul_(2.0)  # queued behind the sleep: work on another stream would read the old rows
        ops.paged_attention(ext_q, cache, batch.block_table, batch.seq_lens, ext_qsl, kg, vg, 0.1, max_query_len=64,
                            out=ext_out)
    stream.synchronize()
    ref = reference.paged_attention_ref(ext_q, cache, batch.block_table, batch.seq_lens, ext_qsl, kg, vg, 0.1,
                                        dtype=torch.float64)
    assert rel_l2(ext_out.float(), ref) < TOL
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                                0.1, max_query_len=1, out=out, plan=plan, workspace=ws)
        out.fill_(float("nan"))
        batch.q.copy_(torch.randn(batch.q.shape, generator=gen).to(torch.bfloat16).to(dev))
        graph.replay()
    stream.synchronize()
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg,
                                        vg, 0.1, dtype=torch.float64)
    assert rel_l2(out.float(), ref) < TOL
