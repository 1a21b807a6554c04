"""What the GPU kernel tests share: the device, the tolerance, random global scales, and the checks
of the writer (bit for bit against the CPU reference) and of decode (against the fp64 reference)."""
from __future__ import annotations

import math

import torch

from gpu_cases import LAYOUTS, fill_random, make_batch, make_cache, rel_l2
from nvfp4_backend import ops, planner, reference
from nvfp4_backend.capabilities import kernels_available
from nvfp4_backend.layout import PagedKVCache

DEV = "cuda"
TOL = 4e-3  # relative L2 vs the fp64 reference on the same dequantized cache (bf16 queries)


def scales(gen, n=2):
    return [torch.tensor(float(torch.empty(()).uniform_(0.05, 4.0, generator=gen)), device=DEV) for _ in range(n)]


def to_cpu(cache):
    """A CPU copy of a cache with the same strides (one tensor per view)."""
    views = []
    for t in cache.tensors():
        cpu = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        cpu.copy_(t.cpu())
        views.append(cpu)
    return PagedKVCache(*views, mode=cache.mode)


def case_layout(index: int, page_size: int) -> str:
    """LAYOUTS[index], rotating through the layouts case by case; vLLM pages hold >= 16 tokens, and
    1-token inline pages are not 16-byte aligned, so those take SGLang's token rows."""
    layout = LAYOUTS[index % len(LAYOUTS)]
    return "token_rows" if page_size == 1 and layout.startswith("inline") else layout


def check_writer(layout, head_dim, dtype, scale_rule, rotation, gen, heads, page_size, tokens=300):
    """The CUDA writer on saturating, subnormal, infinite and NaN blocks and padding slots == the CPU
    reference, bit for bit, in a cache of random bytes (bytes outside the slots stay as they were)."""
    assert kernels_available(torch.device(DEV))
    pages = -(-max(640, 2 * tokens) // page_size)
    x = torch.randn(2, tokens, heads, head_dim, generator=gen) * torch.rand(2, tokens, heads, 1, generator=gen) * 40
    x[0, 5, 1, 3] = 3000.0          # beyond 6 * 448 * g: saturates
    x[1, 7, 0, :16] = 1e-4          # tiny block: subnormal E4M3 scale
    x[0, 9, 2, 20] = float("inf")
    x[1, 11, heads - 1, 40] = float("nan")  # NaN block -> scale 0x7F
    key, value = x[0].to(dtype).to(DEV), x[1].to(dtype).to(DEV)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    slots[::17] = -1                # padding
    slots = slots.to(DEV)
    kg, vg = scales(gen)
    out_kernel, out_ref = make_cache(layout, pages, page_size, heads, head_dim, DEV), make_cache(layout, pages, page_size, heads, head_dim, DEV)
    for c in (out_kernel, out_ref):
        fill_random(c, gen)
    for a, b in zip(out_kernel.tensors(), out_ref.tensors()):
        b.copy_(a)
    torch.ops.nvfp4_backend.write_kv(key, value, slots, *out_kernel.tensors(), kg, vg, scale_rule, rotation)
    ref_cpu = to_cpu(out_ref)  # the reference on the CPU: kernel == CPU reference, bit for bit
    torch.ops.nvfp4_backend.write_kv(key.cpu(), value.cpu(), slots.cpu(), *ref_cpu.tensors(), kg.cpu(), vg.cpu(),
                                     scale_rule, rotation)
    if scale_rule == "6or4" and rotation == "none":  # the rule must have chosen the maximum-of-4 scale somewhere
        six = to_cpu(out_ref)
        reference.write_kv_ref(key.cpu(), value.cpu(), slots.cpu(), six, kg.cpu(), vg.cpu(), "6")
        assert not torch.equal(six.k_block_scales, ref_cpu.k_block_scales)
    for name, a, b in zip(("k_data", "k_scales", "v_data", "v_scales"), out_kernel.tensors(), ref_cpu.tensors()):
        diff = (a.cpu() != b).sum().item()
        assert diff == 0, f"{name}: {diff} bytes differ from the reference ({layout})"


def check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads, window=None, soft_cap=None,
                 sinks=False, splits=None, seq_lens=None, heads_per_block=1, fused=False):
    """Ragged requests (the first only its new tokens, the second one query token fewer) over a cache
    of random bytes: paged_attention with this plan == the fp64 reference, every output written."""
    seq_lens = seq_lens or [q_len + int(x) for x in torch.randint(0, 700, (4,), generator=gen)]
    seq_lens[0] = q_len  # only the new tokens
    q_lens = [q_len] * len(seq_lens)
    q_lens[1] = max(1, q_len - 1)  # ragged q_len inside one batch
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, num_kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, num_kv_heads * group, head_dim, page_size, pages, dtype, gen, DEV)
    kg, vg = scales(gen)
    sink_t = torch.randn(num_kv_heads * group, generator=gen).to(DEV) if sinks else None
    scale = 1 / math.sqrt(head_dim)
    plan = planner.plan_attention(len(seq_lens), num_kv_heads, group, batch.max_query_len, max(seq_lens), head_dim,
                                  heads_per_block=heads_per_block, fused=fused)
    if splits is not None:
        plan = planner.AttentionPlan(splits, len(seq_lens) * num_kv_heads * splits * q_len * group * (head_dim + 2) * 4,
                                     heads_per_block, fused)
    assert plan.heads_per_block == heads_per_block and plan.fused == fused
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, scale,
                        max_query_len=batch.max_query_len, sliding_window=window, logits_soft_cap=soft_cap,
                        sinks=sink_t, out=out, plan=plan)
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, scale, window, soft_cap, sink_t, dtype=torch.float64)
    assert not torch.isnan(out).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out, ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL} ({layout}, D={head_dim}, ps={page_size}, G={group}, q={q_len})"
