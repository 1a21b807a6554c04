"""The extend path (prefill, chunked prefill, long speculative rows) of paged attention on a GPU:
the rows one decode thread block cannot hold (``capabilities.decode_supports``)."""
from __future__ import annotations

import itertools

import torch

from . import reference
from .capabilities import GATHER_MAX_REQUESTS, SUPPORTED_HEAD_DIMS, kernels_available
from .layout import PagedKVCache

EXTEND_CHUNK_TOKENS = 4096
"""Query rows per dense step of the extend path: bounds its score buffer."""
EXTEND_GATHER_TOKENS = 1 << 16
"""Padded cache positions one dequantization of the SDPA extend path may cover: requests are
gathered together (shortest first) up to this, one request at least."""
EXTEND_GATHER_REQUESTS = GATHER_MAX_REQUESTS
"""Requests one dequantization may cover: what one gather kernel launch serves."""


def _gather_kernel_serves(cache: PagedKVCache) -> bool:
    """The gather kernel reads 8-byte pieces of data rows (any page size, single scale bytes), K and
    V through one set of strides (what its binding checks)."""
    return (cache.device.type == "cuda" and cache.head_dim in SUPPORTED_HEAD_DIMS
            and kernels_available(cache.device)
            and cache.k_data.stride() == cache.v_data.stride()
            and cache.k_block_scales.stride() == cache.v_block_scales.stride()
            and all(t.data_ptr() % 8 == 0 and all(st % 8 == 0 for st in t.stride()[:3])
                    for t in (cache.k_data, cache.v_data)))


def extend_attention(q, cache, block_table, seq_lens, query_start_loc, k_global_scale, v_global_scale,
                     softmax_scale, sliding_window=None, logits_soft_cap=None, sinks=None) -> torch.Tensor:
    """Long extends (prefill, chunked prefill) on a GPU: dequantize the requests' pages into a
    dense K/V workspace once (several requests per pass, up to EXTEND_GATHER_TOKENS padded
    positions; the gather kernel where it serves the layout), then dense attention per request.
    Prefill is compute-bound, so reading the NVFP4 pages once per request and layer is not the
    cost that matters here.

    Plain causal attention goes to torch's SDPA (FlashAttention / cuDNN on GPUs) with K/V in fp16
    (bf16 for queries past fp16's range) WITHOUT the global scales: e2m1 x e4m3 products are exact
    there, so the workspace is lossless, and the scales fold into the softmax scale (K) and the
    output (V).  A window, soft-cap or sinks take the reference math in fp32, its score buffer
    bounded by EXTEND_CHUNK_TOKENS query rows.
    """
    from . import jit
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    plain = not sliding_window and not logits_soft_cap and sinks is None
    if plain:
        from torch.nn.attention.bias import causal_lower_right
        one = torch.ones((), dtype=torch.float32, device=q.device)
        scale = float(softmax_scale) * float(k_global_scale)
        # fp16 holds the workspace exactly too (|e2m1 x e4m3| <= 2688) and rounds P and the output
        # 8x finer than bf16, so bf16 queries run in fp16 unless they exceed its range
        work = torch.float16 if q.dtype == torch.float16 or float(q.abs().amax()) < 6e4 else q.dtype
    live = [b for b in range(len(lens)) if qsl[b + 1] > qsl[b]]
    if plain:
        # one dequantization per group of requests instead of one per request: launches and host
        # reads, not bytes, dominated short prefills (the torch-op version took ~90 ops per group)
        groups, group = [], []
        for b in sorted(live, key=lens.__getitem__):
            if group and ((len(group) + 1) * lens[b] > EXTEND_GATHER_TOKENS
                          or len(group) == EXTEND_GATHER_REQUESTS):
                groups.append(group)
                group = []
            group.append(b)
        groups += [group] if group else []
        gather = jit.load(q.device).gather_kv if _gather_kernel_serves(cache) else None
        for group in groups:
            idx = torch.tensor(group, device=block_table.device)
            if gather is not None:  # the requests' positions packed into rows, one kernel launch
                starts = list(itertools.accumulate((lens[b] for b in group), initial=0))
                k = torch.empty((starts[-1], cache.num_kv_heads, cache.head_dim), dtype=work, device=q.device)
                v = torch.empty_like(k)
                gather(*cache.tensors(), block_table[idx], seq_lens[idx],
                       torch.tensor(starts[:-1], dtype=torch.int64).to(q.device, non_blocking=True),
                       max(lens[b] for b in group), k, v)
                rows = [(k[a:z], v[a:z]) for a, z in zip(starts, starts[1:])]
            else:
                k, v = reference.gather_kv_ref(cache, block_table[idx], seq_lens[idx], one, one, work)
                rows = [(k[i, :lens[b]], v[i, :lens[b]]) for i, b in enumerate(group)]
            for b, (kb, vb) in zip(group, rows):
                q_begin, q_end, seq_len = qsl[b], qsl[b + 1], lens[b]
                # [1, heads, tokens, D]; q head h reads kv head h // group size (enable_gqa: no copies)
                kh, vh = (x.transpose(0, 1)[None] for x in (kb, vb))
                qh = q[q_begin:q_end].to(work).transpose(0, 1)[None]
                o = torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, attn_mask=causal_lower_right(q_end - q_begin, seq_len), scale=scale,
                    enable_gqa=True)
                out[q_begin:q_end] = o[0].transpose(0, 1).float() * v_global_scale
        return out
    for b in live:
        q_begin, q_end, seq_len = qsl[b], qsl[b + 1], lens[b]
        k, v = reference.gather_kv_ref(cache, block_table[b:b + 1], seq_lens[b:b + 1], k_global_scale,
                                       v_global_scale)
        for start in range(q_begin, q_end, EXTEND_CHUNK_TOKENS):
            stop = min(start + EXTEND_CHUNK_TOKENS, q_end)
            # rows start..stop are the last (q_end - start) positions of a shorter virtual request
            visible = seq_len - (q_end - stop)
            loc = torch.tensor([0, stop - start], dtype=torch.int32, device=q.device)
            out[start:stop] = reference.attention_ref(
                q[start:stop], k[:, :visible], v[:, :visible], seq_lens.new_tensor([visible]), loc, softmax_scale,
                sliding_window, logits_soft_cap, sinks)
    return out
