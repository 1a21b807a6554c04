"""Paged attention on the kernels: which kernel serves which request of a call.

A request of up to ``capabilities.decode_query_len`` query tokens takes the decode kernel (one thread
block per request and kv head holds all its rows, split-KV where the plan says); a longer one
(prefill, chunked prefill, long speculative rows) takes the prefill kernel
(csrc/prefill_kernel.cuh), one launch for all of them.  The two kernels write disjoint rows (the
decode kernel leaves a longer request alone), so in a mixed step they run side by side: the prefill
kernel on the caller's stream, the decode kernel on a side stream forked from it and joined back,
whose blocks fill the SMs the prefill grid's last wave leaves idle.  A layout the decode kernel cannot
read (``capabilities.decode_kernel_serves``) leaves every request to the prefill kernel.  Neither
reads anything back to the host, so a call captures in a CUDA graph, the fork and join included.
"""
from __future__ import annotations

import contextlib
import threading

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
    decode = decode_len > 0
    prefill = max_query_len > decode_len
    side = _side_stream(q.device)  # made at the thread's first call, before any graph capture that follows it
    caller = side.fork() if decode and prefill else None  # the decode kernel then starts beside the prefill
    try:
        if prefill:
            kernels.paged_prefill(
                out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
                k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks, decode_len + 1,
                rotation)
        if decode:
            with torch.cuda.stream(side.stream) if caller is not None else contextlib.nullcontext():
                kernels.paged_attention(
                    out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
                    k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks, decode_len,
                    num_splits, workspace, rotation, heads_per_block, fused)
    finally:
        if caller is not None:
            side.join(caller)  # the caller's next work waits for the decode kernel, also after an error


class _SideStream:
    """The decode kernel's stream in a mixed step and the two events that fork it from the caller's
    stream and join it back, made once per device and thread (an event recorded again is reused, as a
    captured graph's fork and join nodes allow; the current stream is per thread).  The tensors the
    decode kernel touches belong to the caller's stream, which waits for it before the call returns,
    so the allocator sees no use after the join."""

    def __init__(self, index: int):
        self.stream = torch.cuda.Stream(device=index)
        self.forked, self.done = torch.cuda.Event(), torch.cuda.Event()

    def fork(self) -> torch.cuda.Stream:
        """The side stream starts after the caller's work so far; returns the caller's stream."""
        caller = torch.cuda.current_stream(self.stream.device)
        self.forked.record(caller)
        self.stream.wait_event(self.forked)
        return caller

    def join(self, caller: torch.cuda.Stream) -> None:
        self.done.record(self.stream)
        caller.wait_event(self.done)


_SIDE_STREAMS: dict[tuple[int, int], _SideStream] = {}


def _side_stream(device: torch.device) -> _SideStream:
    """The side stream of ``device`` for the calling thread, made at its first call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, threading.get_ident())
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = _SideStream(index)
    return _SIDE_STREAMS[key]
