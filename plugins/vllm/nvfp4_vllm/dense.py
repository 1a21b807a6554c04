"""The engine's one dense prefill (the core's ``DensePrefill``) per layer shape, made where vLLM's memory
profiling counts it.

vLLM sizes the KV cache from the peak memory of a profiling run, before any metadata builder exists.
The dense prefill's 16-bit workspace (up to 512 MiB at D 128) is therefore made by the first layer
whose forward runs in that profiling run (``attn_metadata`` None), so the peak includes it and the KV
cache is sized around it; the builders made after profiling take the same one.  Tools and tests that
build a builder without a profiling run get it made there.
"""
from __future__ import annotations

import torch

from nvfp4_backend.dense_prefill import DensePrefill
from nvfp4_backend.dense_prefill import unavailable_reason as dense_unavailable_reason
from nvfp4_backend.modes import configured_kv_mode
from vllm.logger import init_logger

from . import BACKEND_NAME

logger = init_logger(f"vllm.{__name__}")

_made: dict[tuple, DensePrefill | str] = {}
"""Per (device, q heads, kv heads, head size, dtype, max batched tokens): the dense prefill, or why
there is none (the prefill kernel then serves long requests)."""


def dense_prefill_for(device, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                      max_num_batched_tokens: int, max_model_len: int,
                      profiling: bool = False) -> tuple[DensePrefill | None, str | None]:
    """(the dense prefill for layers of this shape, None) or (None, why not); made once per process,
    with its merge buffer too where a context (``max_model_len``) can exceed the workspace."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, num_heads, num_kv_heads, head_size, dtype, max_num_batched_tokens)
    if key not in _made:
        reason = dense_unavailable_reason(device)
        if reason is None and configured_kv_mode().rotation != "none":
            reason = "a Hadamard KV mode (the prefill kernel rotates in registers; 16-bit rows would round once more)"
        if reason is None:
            try:
                _made[key] = DensePrefill(device, num_heads, num_kv_heads, head_size, dtype, max_num_batched_tokens)
            except ValueError as exc:  # the bounded workspace cannot hold a step's tokens
                reason = str(exc)
            else:
                if max_model_len > _made[key].capacity:  # steps of several passes can come
                    _made[key].reserve_merge()
        if reason is not None:
            _made[key] = reason
            logger.info(f"{BACKEND_NAME}: prefill on the prefill kernel ({reason})")
        else:
            when = "in vLLM's memory profiling" if profiling else "after vLLM's memory profiling (not counted by it)"
            logger.info(f"{BACKEND_NAME}: dense prefill, {_made[key].allocated_bytes / 2**20:.0f} MiB of 16-bit "
                        f"workspace ({_made[key].capacity} tokens), allocated {when}")
    made = _made[key]
    return (made, None) if isinstance(made, DensePrefill) else (None, made)
