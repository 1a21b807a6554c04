"""Paged attention on the kernels: which kernel serves which request of a call.

A request of up to ``capabilities.decode_query_len`` query tokens takes the decode kernel (one thread
block per request and kv head holds all its rows, split-KV where the plan says); a longer one
(prefill, chunked prefill, long speculative rows) takes the prefill kernel
(csrc/prefill_kernel.cuh), one launch for all of them, after the decode kernel on the same stream.  A
layout the decode kernel cannot read (``capabilities.decode_kernel_serves``) leaves every request to
the prefill kernel.  Neither reads anything back to the host, so a call captures in a CUDA graph.
"""
from __future__ import annotations

import torch

from . import capabilities


def decode_share(max_query_len: int, group_size: int, head_dim: int, decode_query_len: int) -> int:
    """The longest query the decode kernel serves in a call: at most the call's longest and what one
    block holds at this group (``capabilities.decode_query_len``), and at most ``decode_query_len``
    (the plan's) where that is not -1.  Requests longer than it take the prefill kernel."""
    longest = min(max_query_len, capabilities.decode_query_len(group_size, head_dim))
    return longest if decode_query_len < 0 else min(longest, decode_query_len)


def attend_on_kernels(out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens,
                      query_start_loc, k_global_scale, v_global_scale, softmax_scale: float, sliding_window: int,
                      logits_soft_cap: float, sinks, max_query_len: int, num_splits: int, workspace: torch.Tensor,
                      rotation: str, heads_per_block: int, fused: bool, decode_query_len: int) -> None:
    """The op's CUDA implementation.  ``decode_query_len``: the longest query the decode kernel serves
    in this call (the plan's; -1: as many as it holds; 0: it is not launched); every longer request
    goes to the prefill kernel."""
    from . import jit
    kernels = jit.load(q.device)
    decode_len = decode_share(max_query_len, q.shape[1] // k_data.shape[2], q.shape[2], decode_query_len)
    if not capabilities.decode_kernel_serves(k_data, k_block_scales, v_data):
        decode_len = 0
    if decode_len > 0:  # longer requests' first rows too, which the prefill kernel then overwrites
        kernels.paged_attention(
            out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
            k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks, decode_len,
            num_splits, workspace, rotation, heads_per_block, fused)
    if max_query_len > decode_len:
        kernels.paged_prefill(
            out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
            k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks, decode_len + 1,
            rotation)
