"""Prefill over a dequantized 16-bit workspace: the step's long requests read their KV once as 16-bit rows,
then the best dense attention kernel runs on them (FlashInfer's FA3 ragged prefill on Hopper).

Why: the prefill kernel (csrc/prefill_kernel.cuh) dequantizes inside its MMA loop with mma.sync and
runs at about half of FA3's speed on an H200; Hopper's wgmma kernels are what reach it.  Dequantizing
the referenced pages once costs one pass over 0.5625 + 2 x 2 bytes per element (e2m1 x e4m3 is exact
in bf16 and fp16; the global scale rounds once), small beside the attention's O(q_len x kv_len)
work.  vLLM #24197, SGLang's prefill dequant option and LMDeploy do the same (docs/kernels.md).

Pieces:

* ``dequantize_kv``, a custom op: a plan's segments -> K and V workspace rows (csrc/dequantize_kv.cu,
  one launch per pass; on the CPU the same fp32 operations in torch).
* ``DensePrefill``: made once per engine (or layer group): the workspace, bounded in bytes and
  allocated up front, the dense kernel's wrappers and the buffers a multi-pass merge needs.
* ``DensePrefill.plan``: once per step and set of layer features (scale, window, soft cap: models
  that alternate windowed and full layers plan both), on host lengths (the engines' ``seq_lens_cpu``
  / ``query_start_loc_cpu``): ``dense_plan.plan_passes`` and the dense kernel's own plans.  It
  returns the step's ``AttentionPlan`` with ``prefill`` set, or unchanged where the path does not
  apply.  A plan stays valid until the next plan with the same features.
* ``run``: called by ``ops.paged_attention`` for such a plan, after the decode kernel: per pass, the
  dequantize launch and the dense kernel, then the log-sum-exp merge of later passes and the sinks.

Nothing here reads the GPU back or allocates.  The dense kernel's plans live outside CUDA graphs, so
a call being captured runs the prefill kernel instead (``ops``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch

from . import format as fmt
from .dense_plan import Pass, attention_pairs, extend_requests, plan_passes
from .extend import decode_share
from .layout import PagedKVCache
from .planner import AttentionPlan
from .reference import RaggedAttentionRef

DENSE_MIN_FLOPS = 5e10
"""Default ``DensePrefill.min_flops``: below it a step's long requests go to the prefill kernel."""

WORKSPACE_BYTES = 512 << 20
"""Default bound of the K + V workspace (issue #34: 512 MiB at D 128): 131072 tokens of 8 kv heads."""

_lib = torch.library.Library("nvfp4_backend", "FRAGMENT")
_lib.define(
    "dequantize_kv(Tensor(a!) k_out, Tensor(b!) v_out, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
    "Tensor v_block_scales, Tensor block_table, Tensor segments, Tensor k_global_scale, Tensor v_global_scale) "
    "-> ()")


def _dequantize_kv_cpu(k_out, v_out, k_data, k_block_scales, v_data, v_block_scales, block_table, segments,
                       k_global_scale, v_global_scale) -> None:
    """The kernel's operations in torch: e2m1 x e4m3 x global scale in fp32, one rounding to the
    workspace's dtype."""
    rows, requests, positions = segments.tolist()
    page_size = k_data.shape[1]
    for s in range(len(rows) - 1):
        pos = positions[s] + torch.arange(rows[s + 1] - rows[s])
        pages, slots = block_table[requests[s], pos // page_size].long(), pos % page_size
        for data, scales, g, dst in ((k_data, k_block_scales, k_global_scale, k_out),
                                     (v_data, v_block_scales, v_global_scale, v_out)):
            x = fmt.dequantize(data[pages, slots], scales[pages, slots], g)
            dst[rows[s]:rows[s + 1]] = x.to(dst.dtype)


def _dequantize_kv_cuda(k_out, v_out, *args) -> None:
    from . import jit
    jit.load(k_out.device).dequantize_kv(k_out, v_out, *args)


_lib.impl("dequantize_kv", _dequantize_kv_cpu, "CPU")
_lib.impl("dequantize_kv", _dequantize_kv_cuda, "CUDA")


@torch.library.register_fake("nvfp4_backend::dequantize_kv")
def _dequantize_kv_fake(k_out, v_out, *args) -> None:
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the dense path cannot run on ``device`` (None: it can): it needs FlashInfer and a Hopper
    GPU, where its FA3 kernel is the one this path was built and tested for."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the dense prefill runs on CUDA devices, got {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FlashInfer's FA3 prefill needs SM90, {device} is SM{major}{minor}"
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"FlashInfer is not installed ({exc})"
    return None


class FlashInferRagged:
    """The dense kernel: FlashInfer's ragged prefill with its FA3 backend (NHD rows, base-2 LSE)."""

    def __init__(self, device: torch.device):
        import flashinfer
        self._flashinfer = flashinfer
        self._float_workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)

    def new_wrapper(self):
        return self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._float_workspace, "NHD", backend="fa3")

    def plan(self, wrapper, qo_indptr, kv_indptr, *, causal, num_q_heads, num_kv_heads, head_dim, dtype, window_left,
             logits_soft_cap, sm_scale) -> None:
        wrapper.plan(qo_indptr, kv_indptr, num_q_heads, num_kv_heads, head_dim, causal=causal, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype)

    def run(self, wrapper, q, k, v, out, lse, sm_scale: float) -> None:
        # the plan's scale times the layer's K global scale (below): run() reads it from the wrapper
        wrapper._sm_scale = sm_scale
        wrapper.run(q, k, v, out=out, lse=lse, return_lse=lse is not None)

    def merge(self, out, lse, other_out, other_lse) -> None:
        self._flashinfer.merge_state_in_place(out, lse, other_out, other_lse)


@dataclass
class PlannedPass:
    """A pass with its device segment table and its planned dense-kernel wrapper."""
    spec: Pass
    first_row: int  # the query rows of its requests, in the call's q
    last_row: int
    segments: torch.Tensor  # int32 [3, segments + 1] (csrc DequantizeKVParams)
    wrapper: object


@dataclass
class DensePrefillPlan:
    """One step's dense prefill: its passes (the causal one first) and what the call must match."""
    dense: "DensePrefill"
    passes: list[PlannedPass]
    num_requests: int
    decode_len: int
    softmax_scale: float
    sliding_window: int | None
    logits_soft_cap: float | None

    @property
    def first_row(self) -> int:
        return self.passes[0].first_row

    @property
    def covers_all(self) -> bool:
        """Every request of the step is a long one (no decode kernel launch)."""
        return self.passes[0].spec.first_request == 0 and self.passes[0].spec.last_request == self.num_requests

    @property
    def last_row(self) -> int:
        return self.passes[0].last_row


class DensePrefill:
    """The 16-bit workspace and the dense kernel of one engine (or layer group): ``num_q_heads`` /
    ``num_kv_heads`` heads of ``head_dim`` in ``dtype``.  ``workspace_bytes`` bounds K + V (the
    engine's memory profiling counts ``allocated_bytes``); ``max_query_tokens`` is the most query
    tokens a step holds (the engine's max batched tokens), which sizes the merge buffers.

    ``min_flops``: a step whose long requests need fewer attention FLOPs (4 x pairs x q heads x head
    dim) is left to the prefill kernel.  The dense path has a fixed cost per call (a dequantize launch,
    FlashInfer's run, host work in Python) that a small prefill does not earn back; the crossover was
    measured with ``bench --step`` / ``--prefill`` (docs/performance.md).  Tests set 0."""

    min_flops = DENSE_MIN_FLOPS

    def __init__(self, device, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_query_tokens: int, workspace_bytes: int = WORKSPACE_BYTES, attention=None):
        fmt.check_head_dim(head_dim)
        if dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if max_query_tokens <= 0:
            raise ValueError(f"max_query_tokens must be positive, got {max_query_tokens}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors made on it report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.dtype = num_q_heads, num_kv_heads, head_dim, dtype
        row_bytes = 2 * num_kv_heads * head_dim * dtype.itemsize  # a K row and a V row
        self.capacity = workspace_bytes // row_bytes
        if self.capacity < max_query_tokens:
            raise ValueError(f"workspace_bytes = {workspace_bytes} holds {self.capacity} tokens, fewer than "
                             f"max_query_tokens = {max_query_tokens}")
        self.max_query_tokens = max_query_tokens
        kv = torch.empty(2, self.capacity, num_kv_heads, head_dim, dtype=dtype, device=self.device)
        self.k_rows, self.v_rows = kv[0], kv[1]
        self.merge_out = None  # the later passes' output before the merge: made by the first plan that has them
        self.lse = torch.empty(2, max_query_tokens, num_q_heads, dtype=torch.float32, device=self.device)
        self.unit_scale = torch.ones((), dtype=torch.float32, device=self.device)
        if attention is None:  # FA3 on a GPU; on a CPU the same semantics in fp64
            attention = FlashInferRagged(self.device) if self.device.type == "cuda" else RaggedAttentionRef()
        self.attention = attention
        self._wrappers: dict[tuple, list] = {}  # per (scale, window, soft cap): a step may plan several

    @property
    def allocated_bytes(self) -> int:
        """Device memory the path holds for its whole life (for the engine's memory profiling)."""
        held = (self.k_rows, self.v_rows, self.lse) + ((self.merge_out,) if self.merge_out is not None else ())
        return sum(t.numel() * t.element_size() for t in held)

    def reserve_merge(self) -> None:
        """Make now the buffer that steps of several passes (contexts past ``capacity``) merge through,
        which the first such plan makes otherwise: an engine whose memory profiling should count it,
        and whose contexts may exceed the workspace, calls this while it profiles."""
        if self.merge_out is None:
            self.merge_out = torch.empty(self.max_query_tokens, self.num_q_heads, self.head_dim, dtype=self.dtype,
                                         device=self.device)

    def plan(self, plan: AttentionPlan, query_lens: list[int], seq_lens: list[int], *, softmax_scale: float,
             sliding_window: int | None = None, logits_soft_cap: float | None = None) -> AttentionPlan:
        """``plan`` with ``prefill`` set for this step, or ``plan`` itself where the dense path does not
        apply (no long requests, or a step that does not fit)."""
        query_lens, seq_lens = [int(n) for n in query_lens], [int(n) for n in seq_lens]
        if len(query_lens) != len(seq_lens):
            raise ValueError(f"query_lens has {len(query_lens)} entries and seq_lens {len(seq_lens)}")
        decode_len = decode_share(max(query_lens, default=0), self.num_q_heads // self.num_kv_heads, self.head_dim,
                                  -1 if plan.decode_query_len is None else plan.decode_query_len)
        requests = extend_requests(query_lens, decode_len)
        if requests is None or sum(query_lens[b] for b in requests) > self.max_query_tokens:
            return dataclasses.replace(plan, prefill=None)
        pairs = attention_pairs(query_lens, seq_lens, requests, sliding_window)
        if 4 * pairs * self.num_q_heads * self.head_dim < self.min_flops:
            return dataclasses.replace(plan, prefill=None)
        passes = plan_passes(query_lens, seq_lens, requests, sliding_window, self.capacity)
        if passes is None:
            return dataclasses.replace(plan, prefill=None)
        if len(passes) > 1:
            self.reserve_merge()
        wrappers = self._wrappers.setdefault((float(softmax_scale), sliding_window, logits_soft_cap or None), [])
        while len(wrappers) < len(passes):
            wrappers.append(self.attention.new_wrapper())
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        planned = [self._plan_pass(p, starts, wrapper, softmax_scale, sliding_window, logits_soft_cap)
                   for p, wrapper in zip(passes, wrappers)]
        prefill = DensePrefillPlan(self, planned, len(query_lens), decode_len, softmax_scale, sliding_window,
                                   logits_soft_cap)
        return dataclasses.replace(plan, prefill=prefill)

    def _plan_pass(self, p: Pass, starts: list[int], wrapper, softmax_scale, sliding_window, logits_soft_cap):
        first, last = starts[p.first_request], starts[p.last_request]
        qo_indptr = torch.tensor([starts[b] - first for b in range(p.first_request, p.last_request + 1)],
                                 dtype=torch.int32)
        rows = [0, *itertools.accumulate(s.length for s in p.segments)]
        table = torch.tensor([rows, [s.request for s in p.segments] + [0], [s.position for s in p.segments] + [0]],
                             dtype=torch.int32)
        kv_indptr = table[0].clone()
        self.attention.plan(wrapper, qo_indptr, kv_indptr, causal=p.causal, num_q_heads=self.num_q_heads,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                            window_left=sliding_window - 1 if sliding_window else -1,
                            logits_soft_cap=logits_soft_cap or None, sm_scale=float(softmax_scale))
        # pinned: a copy from pageable memory would wait for the stream's queued work
        segments = table.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else table
        return PlannedPass(p, first, last, segments, wrapper)


def check_call(plan: DensePrefillPlan, q: torch.Tensor, cache: PagedKVCache, softmax_scale: float,
               sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """The call must be the one the plan was made for: its heads, dtype, device and features."""
    dense = plan.dense
    expected = (dense.num_q_heads, dense.head_dim, dense.dtype, dense.device, dense.num_kv_heads)
    got = (q.shape[1], q.shape[2], q.dtype, q.device, cache.num_kv_heads)
    if got != expected:
        raise ValueError(f"plan.prefill was made for (q heads, head_dim, dtype, device, kv heads) = {expected}, "
                         f"the call has {got}")
    if q.shape[0] < plan.last_row:
        raise ValueError(f"plan.prefill covers query rows up to {plan.last_row}, q has {q.shape[0]}")
    for name, planned, given in (("softmax_scale", plan.softmax_scale, softmax_scale),
                                 ("sliding_window", plan.sliding_window or None, sliding_window or None),
                                 ("logits_soft_cap", plan.logits_soft_cap or None, logits_soft_cap or None)):
        if planned != given:
            raise ValueError(f"{name} = {given!r}, but plan.prefill was made for {planned!r}")


def run(plan: DensePrefillPlan, out: torch.Tensor, q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
        k_global_scale: float, v_global_scale: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """The plan's passes into ``out``'s rows of the long requests (the decode kernel has served the rest).

    The K global scale, a host number (the engines keep it as a float; ``ops`` serves a call that has it
    only on the GPU with the prefill kernel), multiplies the dense kernel's softmax scale, so the K rows
    stay exact: folded into them it would round once more, which measured 4.0-4.3e-3 of error against
    fp64 on an H200, past the 4e-3 bound.  The V global scale is folded into the V rows."""
    dense = plan.dense
    first, last = plan.first_row, plan.last_row
    k_rows_scale, sm_scale = dense.unit_scale, plan.softmax_scale * float(k_global_scale)
    need_lse = sinks is not None or len(plan.passes) > 1
    lse = dense.lse[0, : last - first] if need_lse else None
    for i, p in enumerate(plan.passes):
        k_rows, v_rows = dense.k_rows[: p.spec.rows], dense.v_rows[: p.spec.rows]
        torch.ops.nvfp4_backend.dequantize_kv(k_rows, v_rows, *cache.tensors(), block_table, p.segments,
                                              k_rows_scale, v_global_scale)
        rows = slice(p.first_row, p.last_row)
        if i == 0:  # the causal pass: every long request's rows
            dense.attention.run(p.wrapper, q[rows], k_rows, v_rows, out[rows], lse, sm_scale)
            continue
        n = p.last_row - p.first_row
        other_out, other_lse = dense.merge_out[:n], dense.lse[1, :n]
        dense.attention.run(p.wrapper, q[rows], k_rows, v_rows, other_out, other_lse, sm_scale)
        dense.attention.merge(out[rows], lse[p.first_row - first: p.last_row - first], other_out, other_lse)
    if sinks is not None:  # a sink adds exp(sink) to the softmax's denominator: out *= sigmoid(lse - sink)
        lse.mul_(math.log(2.0)).sub_(sinks).sigmoid_()
        out[first:last].mul_(lse.unsqueeze(-1))
