"""Plain-PyTorch reference of every op: the oracle for kernel tests and the CPU path.

Vectorized over requests (padded to the longest), no loop over tokens.  Runs on any device.
"""
from __future__ import annotations

import math

import torch

from . import format as fmt
from .layout import PagedKVCache


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKVCache,
                 k_global_scale: torch.Tensor, v_global_scale: torch.Tensor, scale_rule: str = "6") -> None:
    """Quantize K/V ``[tokens, kv_heads, D]`` into the cache slots.

    Slots < 0 (padding) and >= num_slots are skipped: on a GPU nothing can check them without a
    host sync, so the kernel skips them too (the ops wrapper rejects them on CPU).
    """
    keep = (slot_mapping >= 0) & (slot_mapping < cache.num_slots)
    slots = slot_mapping[keep].long()
    page, offset = slots // cache.page_size, slots % cache.page_size
    for x, g, data, scales in ((key, k_global_scale, cache.k_data, cache.k_block_scales),
                               (value, v_global_scale, cache.v_data, cache.v_block_scales)):
        packed, sf = fmt.quantize(x[keep], g, scale_rule)
        data[page, offset] = packed
        scales[page, offset] = sf


def gather_kv_ref(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  k_global_scale, v_global_scale, dtype: torch.dtype = torch.float32):
    """Dequantized K and V ``[batch, max_seq_len, kv_heads, D]``; positions >= seq_len are 0."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    block_table = block_table[: seq_lens.shape[0]]  # CUDA-graph padding may add rows past the batch
    pos = torch.arange(max_len, device=cache.device)
    max_pages = block_table.shape[1]
    page_col = (pos // cache.page_size).clamp(max=max(max_pages - 1, 0))
    live = pos[None, :] < seq_lens[:, None].to(pos.device)
    pages = torch.where(live, block_table[:, page_col].long(), torch.zeros_like(live, dtype=torch.long))
    offset = (pos % cache.page_size).expand_as(pages)
    out = []
    for data, scales, g in ((cache.k_data, cache.k_block_scales, k_global_scale),
                            (cache.v_data, cache.v_block_scales, v_global_scale)):
        x = fmt.dequantize(data[pages, offset], scales[pages, offset], g, dtype)
        out.append(torch.where(live[:, :, None, None], x, torch.zeros_like(x)))
    return out[0], out[1]


def attention_scores_ref(q: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         softmax_scale: float, sliding_window: int | None = None,
                         logits_soft_cap: float | None = None, dtype: torch.dtype = torch.float32):
    """The scores ``attention_ref`` takes its softmax of: ``(scores, rows, q_live)`` with scores
    [batch, kv_heads, group, max_q_len, max_seq_len] (-inf where a query may not look), rows
    [batch, max_q_len] the query row of each (request, query index) and q_live which of them exist.
    Same arguments as ``attention_ref``."""
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    batch, max_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    qsl = query_start_loc.to(device=device, dtype=torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    max_q = int(q_lens.max()) if batch else 0
    qi = torch.arange(max_q, device=device)
    q_live = qi[None, :] < q_lens[:, None]                                  # [B, Q]
    rows = torch.where(q_live, qsl[:-1, None] + qi[None, :], torch.zeros_like(qi)[None, :])
    qp = q[rows].to(dtype).unflatten(2, (num_kv_heads, group))              # [B, Q, Hkv, G, D]
    scores = torch.einsum("bqhgd,blhd->bhgql", qp, k.to(dtype)) * softmax_scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)

    seq = seq_lens.to(device=device, dtype=torch.long)
    q_pos = seq[:, None] - q_lens[:, None] + qi[None, :]                    # [B, Q]
    kv_pos = torch.arange(max_len, device=device)
    visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < seq[:, None, None])
    if sliding_window is not None and sliding_window > 0:
        visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    visible &= q_live[:, :, None]
    return scores.masked_fill(~visible[:, None, None], float("-inf")), rows, q_live


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, softmax_scale: float, sliding_window: int | None = None,
                  logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of ragged queries over padded dense K/V.

    q: [tokens, q_heads, D]; k, v: [batch, max_seq_len, kv_heads, D]; request b owns query rows
    query_start_loc[b]:query_start_loc[b+1], the LAST q_len of its seq_lens[b] positions
    (bottom-right aligned causal mask).  sliding_window W lets a query at position p see
    positions p-W+1..p.  Rows that see no key (and have no sink) output 0.
    Returns fp32/fp64 [tokens, q_heads, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    batch, _, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=dtype, device=q.device)
    if batch == 0 or int((query_start_loc[1:] - query_start_loc[:-1]).max()) == 0:
        return out
    scores, rows, q_live = attention_scores_ref(q, k, seq_lens, query_start_loc, softmax_scale, sliding_window,
                                                logits_soft_cap, dtype)
    if sinks is not None:
        sink = sinks.to(device=q.device, dtype=dtype).view(1, num_kv_heads, group, 1, 1)
        scores = torch.cat([scores, sink.expand(batch, -1, -1, scores.shape[3], 1)], dim=-1)
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(-1, keepdim=True)
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sinks is not None:
        probs = probs[..., :-1]
    o = torch.einsum("bhgql,blhd->bqhgd", probs, v.to(dtype)).flatten(2, 3)  # [B, Q, Hq, D]
    out[rows[q_live]] = o[q_live]
    return out


def paged_attention_ref(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        k_global_scale, v_global_scale, softmax_scale: float,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of ragged queries over the paged NVFP4 cache (decode, spec-decode, extend)."""
    k, v = gather_kv_ref(cache, block_table, seq_lens, k_global_scale, v_global_scale, dtype)
    return attention_ref(q, k, v, seq_lens, query_start_loc, softmax_scale, sliding_window,
                         logits_soft_cap, sinks, dtype)


class RaggedAttentionRef:
    """The dense prefill's kernel (``dense_prefill.FlashInferRagged``) in fp64: the same interface and
    semantics (bottom-right causal mask, ``window_left`` keys left of the diagonal, ``cap * tanh(s / cap)``
    soft cap, base-2 log-sum-exp).  The dense path's kernel on a CPU, and its stand-in in CPU tests."""

    def __init__(self):
        self.runs = 0

    def new_wrapper(self):
        return {}

    def plan(self, wrapper, qo_indptr, kv_indptr, *, causal, num_q_heads, num_kv_heads, head_dim, dtype, window_left,
             logits_soft_cap, sm_scale) -> None:
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu", "plans take host lengths"
        wrapper.clear()
        wrapper.update(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal, window_left=window_left,
                       cap=logits_soft_cap, scale=sm_scale, dtype=dtype, heads=(num_q_heads, num_kv_heads, head_dim))

    def run(self, wrapper, q, k, v, out, lse, sm_scale) -> None:
        self.runs += 1
        qo, kv = wrapper["qo"], wrapper["kv"]
        assert q.shape[0] == qo[-1] and k.shape[0] == kv[-1] and q.dtype == wrapper["dtype"] == k.dtype
        assert (q.shape[1], k.shape[1], q.shape[2]) == wrapper["heads"]
        group = q.shape[1] // k.shape[1]
        for i in range(len(qo) - 1):
            qs = q[qo[i]:qo[i + 1]].double()
            ks = k[kv[i]:kv[i + 1]].double().repeat_interleave(group, dim=1)
            vs = v[kv[i]:kv[i + 1]].double().repeat_interleave(group, dim=1)
            nq, nk = qs.shape[0], ks.shape[0]
            s = torch.einsum("qhd,khd->hqk", qs, ks) * sm_scale
            if wrapper["cap"]:
                s = wrapper["cap"] * torch.tanh(s / wrapper["cap"])
            qi = torch.arange(nq)[:, None] + (nk - nq)
            kj = torch.arange(nk)[None, :]
            visible = torch.ones(nq, nk, dtype=torch.bool)
            if wrapper["causal"]:
                visible &= kj <= qi
            if wrapper["window_left"] >= 0:
                visible &= kj >= qi - wrapper["window_left"]
            s = s.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(s, -1)  # [h, q]
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs)
            out[qo[i]:qo[i + 1]] = o.to(out.dtype)
            if lse is not None:
                lse[qo[i]:qo[i + 1]] = (row_lse / math.log(2.0)).T.float()

    def merge(self, out, lse, other_out, other_lse) -> None:
        m = torch.maximum(lse, other_lse)
        a, b = torch.exp2(lse.double() - m), torch.exp2(other_lse.double() - m)
        merged = (out.double() * a[..., None] + other_out.double() * b[..., None]) / (a + b)[..., None]
        out.copy_(merged.to(out.dtype))
        lse.copy_((m + torch.log2(a + b)).float())
