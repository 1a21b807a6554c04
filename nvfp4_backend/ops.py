"""Public ops: quantize-on-write and paged attention over an NVFP4 cache.

Each is a ``torch.library`` custom op (``torch.ops.nvfp4_backend.*``) with a fake implementation,
so it traces under ``torch.compile`` and captures in CUDA graphs.  On CUDA tensors the op runs the
JIT-built kernels (``nvfp4_backend.jit``: ``extend`` says which kernel serves which request of a
paged-attention call); elsewhere, or at a head dim they are not built for, the reference.  The
split-KV plan comes from ``planner``.  The Python wrappers validate every argument first, so bad input raises a
``ValueError``/``TypeError`` naming the argument and nothing is written.
"""
from __future__ import annotations

import functools
import math

import torch

from . import capabilities, dense_prefill, planner, reference
from . import format as fmt
from .extend import attend_on_kernels, decode_share
from .layout import PagedKVCache
from .planner import AttentionPlan

_lib = torch.library.Library("nvfp4_backend", "DEF")
_lib.define(
    "write_kv(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) k_data, Tensor(b!) k_block_scales, "
    "Tensor(c!) v_data, Tensor(d!) v_block_scales, Tensor k_global_scale, Tensor v_global_scale, "
    "str scale_rule=\"6\", str rotation=\"none\") -> ()")
_lib.define(
    "paged_attention(Tensor(a!) out, Tensor q, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
    "Tensor v_block_scales, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
    "Tensor k_global_scale, Tensor v_global_scale, float softmax_scale, int sliding_window, "
    "float logits_soft_cap, Tensor? sinks, int max_query_len, int num_splits, Tensor(b!) workspace, "
    "str rotation=\"none\", int heads_per_block=1, bool fused=False, int decode_query_len=-1) -> ()")

QUERY_DTYPES = (torch.float16, torch.bfloat16)


# ============================================================================ validation
def _check_tensor(name: str, t, dtypes, dim: int | None = None, device: torch.device | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the cache's device)")


def _check_rows_aligned(name: str, t: torch.Tensor) -> None:
    """The decode kernel reads query rows and writes output rows in 16-byte pieces."""
    misaligned = [f"stride({i})" for i in range(t.dim() - 1) if t.shape[i] > 1 and t.stride(i) * t.element_size() % 16]
    if t.data_ptr() % 16:
        misaligned.insert(0, "data pointer")
    if misaligned:
        raise ValueError(f"{name} rows must be 16-byte aligned (data pointer and token / head strides multiples of 16 "
                         f"bytes), got {', '.join(misaligned)} off (strides {t.stride()}, storage offset "
                         f"{t.storage_offset()})")


def _host_checks() -> bool:
    """Value checks that read tensor contents run eagerly only: under torch.compile they would be
    data-dependent, and on a GPU they would synchronize (and break CUDA-graph capture)."""
    return not torch.compiler.is_compiling()


def _check_global_scale(name: str, t, device: torch.device) -> torch.Tensor:
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"{name} must be a positive finite number, got {t}")
        return torch.full((), float(t), dtype=torch.float32, device=device)  # a fill kernel: no copy, no sync
    _check_tensor(name, t, (torch.float32,), device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one fp32 value, got shape {tuple(t.shape)}")
    if device.type == "cpu" and _host_checks() and not (float(t) > 0 and math.isfinite(float(t))):
        raise ValueError(f"{name} must be positive and finite, got {float(t)}")
    return t if t.dim() == 0 else t.reshape(())


def _check_cache(cache) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    cache.validate()
    return cache


# ============================================================================ write
def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKVCache,
             k_global_scale, v_global_scale) -> None:
    """Quantize ``key``/``value`` [tokens, kv_heads, D] (fp16/bf16) into ``slot_mapping``'s slots.

    Slot s is token s % page_size of page s // page_size; negative slots are skipped (padding).
    """
    cache = _check_cache(cache)
    dev = cache.device
    _check_tensor("key", key, QUERY_DTYPES, 3, dev)
    _check_tensor("value", value, (key.dtype,), 3, dev)
    want = (key.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [tokens, kv_heads, head_dim] = {want}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    _check_tensor("slot_mapping", slot_mapping, (torch.int64, torch.int32), 1, dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if dev.type == "cpu" and _host_checks() and slot_mapping.numel() and int(slot_mapping.max()) >= cache.num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())} but the cache has {cache.num_slots} slots")
    kg = _check_global_scale("k_global_scale", k_global_scale, dev)
    vg = _check_global_scale("v_global_scale", v_global_scale, dev)
    torch.ops.nvfp4_backend.write_kv(key, value, slot_mapping, *cache.tensors(), kg, vg, cache.mode.scale_rule,
                                     cache.mode.rotation)


@functools.lru_cache(maxsize=None)
def _hadamard_on(head_dim: int, device: torch.device) -> torch.Tensor:
    # built and copied to the device once, not on every write and attention call
    return fmt.hadamard(head_dim, device)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """x H along the head dim (H orthonormal, symmetric, its own inverse), in fp32, back to x's dtype."""
    return (x.float() @ _hadamard_on(x.shape[-1], x.device)).to(x.dtype)


def _write_kv_impl(key, value, slot_mapping, k_data, k_block_scales, v_data, v_block_scales,
                   k_global_scale, v_global_scale, scale_rule="6", rotation="none") -> None:
    from . import jit
    # head dims the kernels were tested with on a GPU; any other multiple of 16 takes the reference
    if (key.is_cuda and key.shape[-1] in capabilities.SUPPORTED_HEAD_DIMS
            and capabilities.kernels_available(key.device)):
        if key.stride() != value.stride() or any(st % 8 for st in key.stride()[:2]):
            # the kernel reads K and V with one set of 16-byte-aligned strides (torch calls a tensor
            # contiguous whatever the stride of a size-1 dim, so copy into fresh standard strides)
            key = torch.empty(key.shape, dtype=key.dtype, device=key.device).copy_(key)
            value = torch.empty(value.shape, dtype=value.dtype, device=value.device).copy_(value)
        jit.load(key.device).write_kv(key, value, slot_mapping.long(), k_data, k_block_scales, v_data,
                                      v_block_scales, k_global_scale, v_global_scale, scale_rule, rotation)
        return
    if rotation == "hadamard":  # the writer's rotation, fmt.hadamard_transform, rounded to the input dtype
        key = fmt.hadamard_transform(key).to(key.dtype)
        value = fmt.hadamard_transform(value).to(value.dtype)
    cache = PagedKVCache(k_data, k_block_scales, v_data, v_block_scales)
    reference.write_kv_ref(key, value, slot_mapping, cache, k_global_scale, v_global_scale, scale_rule)


_lib.impl("write_kv", _write_kv_impl, "CPU")
_lib.impl("write_kv", _write_kv_impl, "CUDA")


@torch.library.register_fake("nvfp4_backend::write_kv")
def _write_kv_fake(key, value, slot_mapping, k_data, k_block_scales, v_data, v_block_scales,
                   k_global_scale, v_global_scale, scale_rule="6", rotation="none") -> None:
    return None


def paged_attention(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, k_global_scale, v_global_scale, softmax_scale: float, *,
                    max_query_len: int | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, plan: AttentionPlan | None = None,
                    workspace: torch.Tensor | None = None, seq_lens_cpu: torch.Tensor | None = None,
                    query_start_loc_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ragged queries over the paged NVFP4 cache: decode, speculative decode, prefill,
    chunked prefill, or a batch mixing them.

    q: [tokens, q_heads, D] fp16/bf16; request b owns rows query_start_loc[b]:query_start_loc[b+1]
    and sees its first seq_lens[b] cache positions (those rows are the last q_len of them;
    bottom-right causal mask).  block_table: [batch, max_pages] int32 page indices.
    Returns ``out`` ([tokens, q_heads, D], q's dtype), allocated when not given.

    ``max_query_len``: at least the longest request's query length (read from ``query_start_loc``
    when not given); under a smaller bound a longer request may be left unwritten.
    Nothing is read back from the GPU when ``max_query_len`` and ``plan`` are given, or when the
    lengths are also given on the host (``seq_lens_cpu``, ``query_start_loc_cpu``: the engines have
    them), so the call captures in a CUDA graph; with ``out`` and ``workspace`` given too it
    allocates nothing.
    """
    cache = _check_cache(cache)
    dev = cache.device
    _check_tensor("q", q, QUERY_DTYPES, 3, dev)
    if q.shape[2] != cache.head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has head_dim {cache.head_dim}")
    if q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {cache.num_kv_heads} kv heads")
    group = q.shape[1] // cache.num_kv_heads
    most = capabilities.prefill_rows(cache.head_dim)  # 0: a head dim the kernels are not built for
    if dev.type == "cuda" and 0 < most < group:
        raise ValueError(f"q has {group} q heads per kv head: the kernels take at most {most} at head_dim "
                         f"{cache.head_dim}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dimension, got strides {q.stride()}")
    _check_tensor("block_table", block_table, (torch.int32,), 2, dev)
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    _check_tensor("seq_lens", seq_lens, (torch.int32,), 1, dev)
    _check_tensor("query_start_loc", query_start_loc, (torch.int32,), 1, dev)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must have batch + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}")
    if block_table.shape[0] < batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
    if not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    planner.check_sliding_window(sliding_window)
    if logits_soft_cap is not None and not (logits_soft_cap >= 0 and math.isfinite(logits_soft_cap)):
        raise ValueError(f"logits_soft_cap must be positive and finite or None, got {logits_soft_cap}")
    if sinks is not None:
        _check_tensor("sinks", sinks, (torch.float32,), 1, dev)
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks must have one value per q head ({q.shape[1]}), got {sinks.shape[0]}")
    kg = _check_global_scale("k_global_scale", k_global_scale, dev)
    vg = _check_global_scale("v_global_scale", v_global_scale, dev)
    if dev.type == "cpu" and _host_checks() and batch:
        _check_ranges(q, cache, block_table, seq_lens, query_start_loc)
    if out is None:
        out = torch.zeros_like(q)
    else:
        _check_tensor("out", out, (q.dtype,), 3, dev)
        if out.shape != q.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    if _host_checks():  # on every path, so the rule does not depend on the device; under
        for name, t in (("q", q), ("out", out)):  # torch.compile the binding checks the kernel's inputs
            _check_rows_aligned(name, t)
    max_query_len, plan = _step_plan(batch, cache, group, query_start_loc, seq_lens, query_start_loc_cpu,
                                     seq_lens_cpu, max_query_len, plan, sliding_window)
    if not 1 <= plan.num_splits <= capabilities.MAX_SPLITS:
        raise ValueError(f"plan.num_splits must lie in [1, {capabilities.MAX_SPLITS}], got {plan.num_splits}")
    decode_len = decode_share(max_query_len, group, cache.head_dim,
                              -1 if plan.decode_query_len is None else plan.decode_query_len)
    if decode_len > 0:  # no decode rows at all: the plan is not used
        planner.check_heads_per_block("plan.heads_per_block", group, decode_len, plan.heads_per_block,
                                      cache.head_dim, plan.fused)
    if workspace is None:
        workspace = plan.allocate_workspace(dev)
    elif workspace.device != dev:
        raise ValueError(f"workspace is on {workspace.device}, expected {dev} (the cache's device)")
    elif workspace.numel() < plan.workspace_bytes:
        raise ValueError(f"workspace holds {workspace.numel()} bytes, the plan needs {plan.workspace_bytes}")
    elif plan.num_splits > 1 and workspace.data_ptr() % 16:
        raise ValueError("workspace must be 16-byte aligned (the kernel's merge reads it in 16-byte pieces)")
    dense = _dense_plan(plan, q, cache, k_global_scale, softmax_scale, sliding_window, logits_soft_cap)
    if dense is not None:  # the decode kernel serves the short requests, the dense path the rest
        max_query_len = min(max_query_len, dense.decode_len)
    if dense is None or not dense.covers_all:
        # a rotated cache (k H, v H): q H in and the output (P V H) rotated back, inside the kernel
        torch.ops.nvfp4_backend.paged_attention(
            out, q, *cache.tensors(), block_table, seq_lens, query_start_loc, kg, vg,
            float(softmax_scale), int(sliding_window or 0), float(logits_soft_cap or 0.0), sinks, int(max_query_len),
            plan.num_splits, workspace, cache.mode.rotation, plan.heads_per_block, plan.fused, decode_len)
    if dense is not None:
        dense_prefill.run(dense, out, q, cache, block_table, _on_host(k_global_scale), vg, sinks)
    return out


def _on_host(scale) -> float | None:
    """A global scale's value where reading it costs no synchronization (a number or a CPU tensor)."""
    if isinstance(scale, (int, float)):
        return float(scale)
    return float(scale) if scale.device.type == "cpu" else None


def _dense_plan(plan: AttentionPlan, q, cache, k_global_scale, softmax_scale, sliding_window, logits_soft_cap):
    """The plan's dense prefill where this call runs it: not while a CUDA graph is captured (its
    plans live outside graphs: the prefill kernel serves the step), not on a Hadamard-mode cache (the
    rows rotated back would round once more: dense_prefill), not with the K global scale only on the
    GPU (reading it would synchronize; folded into the K rows it would round once more), nor on a
    layout the decode kernel does not read (the prefill kernel then serves every request)."""
    dense = plan.prefill
    if dense is None:
        return None
    if not isinstance(dense, dense_prefill.DensePrefillPlan):
        raise TypeError(f"plan.prefill must be a DensePrefillPlan or None, got {type(dense).__name__}")
    dense_prefill.check_call(dense, q, cache, softmax_scale, sliding_window, logits_soft_cap)
    if cache.mode.rotation != "none" or _on_host(k_global_scale) is None or (q.is_cuda and (
            torch.cuda.is_current_stream_capturing()
            or not capabilities.decode_kernel_serves(cache.k_data, cache.k_block_scales, cache.v_data))):
        return None
    return dense


def _step_plan(batch, cache, group, query_start_loc, seq_lens, query_start_loc_cpu, seq_lens_cpu, max_query_len,
               plan, sliding_window) -> tuple[int, AttentionPlan]:
    """The call's longest query and its plan, the given ones or made here: from the host lengths where
    given (no GPU read), else from the device tensors (a synchronization)."""
    for name, t, n in (("seq_lens_cpu", seq_lens_cpu, batch), ("query_start_loc_cpu", query_start_loc_cpu, batch + 1)):
        if t is not None:
            _check_tensor(name, t, (torch.int32, torch.int64), 1, torch.device("cpu"))
            if t.shape[0] != n:
                raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    qsl = query_start_loc if query_start_loc_cpu is None else query_start_loc_cpu
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if batch else 0
    if plan is None:
        lens = seq_lens if seq_lens_cpu is None else seq_lens_cpu
        max_seq_len = int(lens.max()) if batch else 0
        query_lens = None if query_start_loc_cpu is None else (qsl[1:] - qsl[:-1]).tolist()
        plan = planner.plan_attention(batch, cache.num_kv_heads, group, max(max_query_len, 1), max_seq_len,
                                      cache.head_dim, planner.num_sms(cache.device), token_major=cache.token_major,
                                      device=cache.device, query_lens=query_lens, sliding_window=sliding_window)
    else:
        limit = capabilities.decode_query_len(group, cache.head_dim)
        if plan.decode_query_len is not None and not (isinstance(plan.decode_query_len, int)
                                                      and 0 <= plan.decode_query_len <= limit):
            raise ValueError(f"plan.decode_query_len must be an int in [0, {limit}], got {plan.decode_query_len!r}")
    return max_query_len, plan


def _check_ranges(q, cache, block_table, seq_lens, query_start_loc) -> None:
    """Index ranges, checked where reading them is free (CPU tensors)."""
    qsl = query_start_loc.tolist()
    if any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[0] < 0 or qsl[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc must rise from >= 0 to <= {q.shape[0]} query tokens, got {qsl}")
    lens = seq_lens.tolist()
    for b, (s, a, e) in enumerate(zip(lens, qsl, qsl[1:])):
        if e - a > s:  # the queries are the last q_len of the request's seq_len positions
            raise ValueError(f"seq_lens[{b}] = {s} is shorter than the request's {e - a} query tokens")
    capacity = block_table.shape[1] * cache.page_size
    if min(lens) < 0 or max(lens) > capacity:
        raise ValueError(f"seq_lens must lie in [0, {capacity}] (block_table width x page_size), got max {max(lens)}")
    pages = [(s + cache.page_size - 1) // cache.page_size for s in lens]
    for b, n in enumerate(pages):
        row = block_table[b, :n]
        if n and (int(row.min()) < 0 or int(row.max()) >= cache.num_pages):
            raise ValueError(f"block_table row {b} holds a page outside [0, {cache.num_pages})")


def _paged_attention_impl(out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens,
                          query_start_loc, k_global_scale, v_global_scale, softmax_scale, sliding_window,
                          logits_soft_cap, sinks, max_query_len, num_splits, workspace, rotation="none",
                          heads_per_block=1, fused=False, decode_query_len=-1) -> None:
    if q.is_cuda and q.shape[2] in capabilities.SUPPORTED_HEAD_DIMS and capabilities.kernels_available(q.device):
        attend_on_kernels(out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens,
                          query_start_loc, k_global_scale, v_global_scale, softmax_scale, sliding_window,
                          logits_soft_cap, sinks, max_query_len, num_splits, workspace, rotation, heads_per_block,
                          fused, decode_query_len)
        return
    rotated = rotation == "hadamard"
    cache = PagedKVCache(k_data, k_block_scales, v_data, v_block_scales)
    res = reference.paged_attention_ref(_rotate(q) if rotated else q, cache, block_table, seq_lens, query_start_loc,
                                        k_global_scale, v_global_scale, softmax_scale, sliding_window or None,
                                        logits_soft_cap or None, sinks)
    if rotated:  # the fp32 result rotated back, then rounded once into out
        res = _rotate(res)
    # rows that belong to no request are left as they were, as the kernels leave them
    first, last = int(query_start_loc[0]), int(query_start_loc[-1])
    out[first:last].copy_(res[first:last])


_lib.impl("paged_attention", _paged_attention_impl, "CPU")
_lib.impl("paged_attention", _paged_attention_impl, "CUDA")


@torch.library.register_fake("nvfp4_backend::paged_attention")
def _paged_attention_fake(out, q, *args) -> None:
    return None
