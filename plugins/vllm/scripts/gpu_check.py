"""GPU check of the calls the vLLM backend makes, for a GPU machine without vLLM installed.

vLLM itself cannot be installed on the lent GPU machines (no network, and vLLM with its
dependencies is far over what can be carried), so this script reproduces, in plain torch, the
per-layer KV views vLLM's ``create_kv_cache_views`` hands the backend for each page-dense layout,
views them as ``Nvfp4XqaImpl._paged_cache`` does, and runs the backend's call pattern through the
CUDA kernels:

  * ``ops.write_kv`` on the GPU, bytes compared with the CPU reference writer;
  * decode via ``ops.paged_attention`` with a plan for ``max_model_len`` and a preallocated
    workspace, captured in a CUDA graph and replayed after the sequences grew (what a FULL graph
    does in vLLM), compared with the reference;
  * a decode batch of 128 requests, for which the planner puts several kv heads in one thread block;
  * a mixed step's prefill rows (dense path) compared with the reference;
  * a mixed batch's FULL graph as ``build_for_cudagraph_capture`` makes it (one call over every
    request, captured on vLLM's dummy batch), replayed for two different mixes written into its
    buffers.

    python plugins/vllm/scripts/gpu_check.py     # exits non-zero on any mismatch
"""
from __future__ import annotations

import math
import sys
import time

import torch

from nvfp4_backend import PagedKVCache, capabilities, ops, planner, reference
from nvfp4_backend import format as fmt

DEV = torch.device("cuda")
NUM_HEADS, NUM_KV_HEADS, HEAD = 32, 8, 128
BLOCK, NUM_BLOCKS, LAYERS = 16, 1024, 2
MAX_MODEL_LEN = 4096
LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


def vllm_layer_view(raw: torch.Tensor, layout: str, layer: int) -> torch.Tensor:
    """vLLM's 4-D [blocks, 2 * kv_heads, block, D/2 + D/16] uint8 view of one layer."""
    content = fmt.bytes_per_token_head(HEAD)
    slots = 2 * NUM_KV_HEADS
    page = slots * BLOCK * content
    layer_stride, block_stride = (page * NUM_BLOCKS, page) if layout.startswith("L") else (page, page * LAYERS)
    head_major = layout.endswith("HNC")
    inner = (BLOCK * content, content, 1) if head_major else (content, slots * content, 1)
    return raw.as_strided((NUM_BLOCKS, slots, BLOCK, content), (block_stride, *inner), layer * layer_stride)


def paged_cache(kv_cache: torch.Tensor, head_major: bool) -> PagedKVCache:
    pages = kv_cache if head_major else kv_cache.transpose(1, 2)  # as Nvfp4XqaImpl._paged_cache
    return PagedKVCache.from_inline_pages(pages, BLOCK, NUM_KV_HEADS, HEAD, head_major=head_major)


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 2e-2) -> bool:
    err = (got.double().cpu() - want.double().cpu()).abs().max().item()
    ok = math.isfinite(err) and err <= atol
    print(f"  {name:<44} max|err| {err:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def require(name: str, condition: bool) -> bool:
    """A check that is not a numeric comparison, named in the output like the others."""
    print(f"  {name:<44} {'ok' if condition else 'FAIL'}")
    return bool(condition)


def run_layout(layout: str, gen: torch.Generator) -> bool:
    print(f"{layout}:")
    raw = torch.randint(0, 256, (2 * NUM_KV_HEADS * BLOCK * fmt.bytes_per_token_head(HEAD) * NUM_BLOCKS * LAYERS,),
                        dtype=torch.uint8, generator=gen).to(DEV)
    kv_cache = vllm_layer_view(raw, layout, layer=1)
    cache = paged_cache(kv_cache, layout.endswith("HNC"))
    other_before = vllm_layer_view(raw, layout, layer=0).clone()

    # 64 decodes (graph-captured), then 2 prefills of the same step; partial last pages.
    batch, max_pages = 64, MAX_MODEL_LEN // BLOCK
    seq_lens = torch.randint(1, 3000, (batch,), generator=gen, dtype=torch.int32)
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: batch * 12] + 1
    block_table = torch.zeros(batch, max_pages, dtype=torch.int32)
    for b in range(batch):  # enough distinct pages for the first 12 * 16 tokens; the rest reuse them
        block_table[b] = perm[b * 12:(b + 1) * 12].repeat(max_pages // 12 + 1)[:max_pages]
    # write every position each request can reach, so replays over longer lengths read written bytes
    tokens = [(b, p) for b in range(batch) for p in range(12 * BLOCK)]
    slots = torch.tensor([int(block_table[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in tokens])
    k = torch.randn(len(tokens), NUM_KV_HEADS, HEAD, generator=gen).bfloat16()
    v = torch.randn(len(tokens), NUM_KV_HEADS, HEAD, generator=gen).bfloat16()
    k_scale = torch.tensor(0.5, device=DEV)
    v_scale = torch.tensor(0.25, device=DEV)
    ops.write_kv(k.to(DEV), v.to(DEV), slots.to(DEV), cache, k_scale, v_scale)
    cpu = PagedKVCache.allocate(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD)
    ops.write_kv(k, v, slots, cpu, k_scale.cpu(), v_scale.cpu())
    page, offset = slots // BLOCK, slots % BLOCK
    ok = require("write_kv GPU bytes == reference bytes",
                 all(torch.equal(g.cpu()[page, offset], c[page, offset]) for g, c in zip(cache.tensors(), cpu.tensors())))
    ok &= require("the other layer's pages untouched", torch.equal(other_before, vllm_layer_view(raw, layout, layer=0)))
    seq_lens = seq_lens.clamp(max=12 * BLOCK)

    # decode: plan for max_model_len once, capture, replay after the sequences grew.  Like vLLM's
    # FULL graphs, the batch is padded to the capture size with requests of 0 query tokens and
    # 0 cached tokens.
    pad = 4
    qsl = torch.cat([torch.arange(batch + 1), torch.full((pad,), batch)]).to(torch.int32)
    plan = planner.plan_attention(batch + pad, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, 1, MAX_MODEL_LEN, HEAD,
                                  planner.num_sms(DEV))
    workspace = plan.allocate_workspace(DEV)
    q = torch.randn(batch, NUM_HEADS, HEAD, generator=gen).bfloat16().to(DEV)
    out = torch.empty_like(q)
    padded = lambda x: torch.cat([x, torch.zeros((pad, *x.shape[1:]), dtype=x.dtype)])
    d_seq, d_bt, d_qsl = padded((seq_lens // 2).clamp(min=1)).to(DEV), padded(block_table).to(DEV), qsl.to(DEV)

    def decode():
        ops.paged_attention(q, cache, d_bt, d_seq, d_qsl, k_scale, v_scale, HEAD ** -0.5, max_query_len=1,
                            out=out, plan=plan, workspace=workspace)

    decode()  # warm up (and build) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    d_seq.copy_(padded(seq_lens).to(DEV))  # the next steps: longer sequences, new queries
    q.copy_(torch.randn(q.shape, generator=gen).bfloat16().to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    want = reference.paged_attention_ref(q.cpu(), cpu, block_table, seq_lens, qsl[:batch + 1], k_scale.cpu(),
                                         v_scale.cpu(), HEAD ** -0.5)
    ok &= check(f"decode {batch}+{pad} pad, graph replay (splits={plan.num_splits})", out, want)
    t0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    print(f"  decode replay {1e6 * (time.perf_counter() - t0) / 20:.1f} us/step (one layer)")

    # a decode batch large enough that the planner packs kv heads into thread blocks: 128 requests
    # over the same pages (each block then streams several kv heads of vLLM's inline pages)
    many = 128
    pick = torch.arange(many) % batch
    m_bt, m_seq, m_qsl = block_table[pick], seq_lens[pick], torch.arange(many + 1, dtype=torch.int32)
    m_plan = planner.plan_attention(many, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, 1, MAX_MODEL_LEN, HEAD,
                                    planner.num_sms(DEV))
    mq = torch.randn(many, NUM_HEADS, HEAD, generator=gen).bfloat16()
    m_out = ops.paged_attention(mq.to(DEV), cache, m_bt.to(DEV), m_seq.to(DEV), m_qsl.to(DEV), k_scale, v_scale,
                                HEAD ** -0.5, max_query_len=1, plan=m_plan, workspace=m_plan.allocate_workspace(DEV))
    want = reference.paged_attention_ref(mq, cpu, m_bt, m_seq, m_qsl, k_scale.cpu(), v_scale.cpu(), HEAD ** -0.5)
    ok &= check(f"decode {many} requests ({m_plan.heads_per_block} kv heads per block)", m_out, want)
    # the fused kernel takes up to 8 kv heads per block, the static one 2 or 4: any packing will do
    ok &= require("the plan packs kv heads into blocks", m_plan.heads_per_block > 1)

    # prefill rows of a mixed step: 2 requests with 100 and 37 new tokens (dense path)
    p_q_lens, p_ctx = [100, 37], [50, 0]
    p_seq = torch.tensor([c + n for c, n in zip(p_ctx, p_q_lens)], dtype=torch.int32)
    p_qsl = torch.tensor([0, 100, 137], dtype=torch.int32)
    p_bt = block_table[:2].contiguous()
    pq = torch.randn(137, NUM_HEADS, HEAD, generator=gen).bfloat16()
    p_out = ops.paged_attention(pq.to(DEV), cache, p_bt.to(DEV), p_seq.to(DEV), p_qsl.to(DEV), k_scale, v_scale,
                                HEAD ** -0.5, max_query_len=100, plan=planner.AttentionPlan(1, 0), workspace=workspace)
    want = reference.paged_attention_ref(pq, cpu, p_bt, p_seq, p_qsl, k_scale.cpu(), v_scale.cpu(), HEAD ** -0.5)
    ok &= check("prefill rows (dense path)", p_out, want)
    # short extends (3 new tokens x group 4 = 12 rows): the kernel path with its own plan
    e_qsl = torch.tensor([0, 3, 6], dtype=torch.int32)
    e_seq = seq_lens[:2].clamp(min=3)
    e_plan = planner.plan_attention(2, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, 3, int(e_seq.max()), HEAD,
                                    planner.num_sms(DEV))
    eq = torch.randn(6, NUM_HEADS, HEAD, generator=gen).bfloat16()
    e_out = ops.paged_attention(eq.to(DEV), cache, p_bt.to(DEV), e_seq.to(DEV), e_qsl.to(DEV), k_scale, v_scale,
                                HEAD ** -0.5, max_query_len=3, plan=e_plan, workspace=e_plan.allocate_workspace(DEV))
    want = reference.paged_attention_ref(eq, cpu, p_bt, e_seq, e_qsl, k_scale.cpu(), v_scale.cpu(), HEAD ** -0.5)
    ok &= check("short extends (kernel path)", e_out, want)
    ok &= mixed_full_graph(cache, cpu, block_table, k_scale, v_scale, gen)
    return bool(ok)


def mixed_full_graph(cache, cpu, block_table, k_scale, v_scale, gen) -> bool:
    """cudagraph_mode FULL: a graph of 192 tokens captured on vLLM's dummy batch (one token per
    request, max_query_len 192) as one call over every request, then replayed for steps vLLM writes
    into the same buffers: decodes plus prefill chunks, then decodes only (requests padded with no
    tokens, rows past the step untouched).  Every position up to 192 of the first requests is written."""
    tokens, reqs, group = 192, 64, NUM_HEADS // NUM_KV_HEADS
    qsl = torch.arange(reqs + 1, dtype=torch.int32, device=DEV).clamp(max=tokens)
    seq = torch.ones(reqs, dtype=torch.int32, device=DEV)
    table = block_table[:reqs].clone().to(DEV)
    q = torch.randn(tokens, NUM_HEADS, HEAD, generator=gen).bfloat16().to(DEV)
    out = torch.full_like(q, float("nan"))
    plan = planner.plan_attention(reqs, NUM_KV_HEADS, group, tokens, MAX_MODEL_LEN, HEAD, planner.num_sms(DEV))
    workspace = plan.allocate_workspace(DEV)

    def step():
        ops.paged_attention(q, cache, table, seq, qsl, k_scale, v_scale, HEAD ** -0.5, max_query_len=tokens,
                            out=out, plan=plan, workspace=workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ok = True
    for name, q_lens, ctx in (("20 decodes + chunks of 100 and 37", [1] * 20 + [100, 37], [150] * 20 + [60, 0]),
                              ("48 decodes", [1] * 48, [17 + 3 * b for b in range(48)])):
        n, rows = len(q_lens), sum(q_lens)
        lens = torch.tensor([c + k for c, k in zip(ctx, q_lens)], dtype=torch.int32)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        qsl.copy_(torch.cat([starts, torch.full((reqs - n,), rows, dtype=torch.int32)]).to(DEV))
        seq.copy_(torch.cat([lens, torch.zeros(reqs - n, dtype=torch.int32)]).to(DEV))
        q.copy_(torch.randn(q.shape, generator=gen).bfloat16().to(DEV))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.paged_attention_ref(q[:rows].cpu(), cpu, block_table[:n], lens, starts, k_scale.cpu(),
                                             v_scale.cpu(), HEAD ** -0.5)
        ok &= check(f"mixed FULL graph replay: {name}", out[:rows], want)
        ok &= require(f"rows past the step untouched ({name})", bool(out[rows:].isnan().all()))
    return ok


def main() -> int:
    print(torch.cuda.get_device_name(DEV), "kernels:", capabilities.kernels_available(DEV))
    gen = torch.Generator().manual_seed(0)
    results = {layout: run_layout(layout, gen) for layout in LAYOUTS}
    print("RESULT", "PASS" if all(results.values()) else f"FAIL {[k for k, v in results.items() if not v]}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
