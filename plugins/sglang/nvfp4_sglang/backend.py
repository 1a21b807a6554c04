"""``nvfp4-xqa``: SGLang attention over its NVFP4 KV pool through nvfp4_backend's ops.

SGLang's pool (``MHATokenToKVPool`` with the ``nvfp4`` recipe) keeps, per layer, token rows
``k_buffer[l]`` [rows, kv_heads, D/2] uint8 (E2M1 pairs) and ``k_scale_buffer[l]`` [rows,
kv_heads, D/16] (E4M3 bytes), same for V; slot s = ``out_cache_loc`` / ``req_to_token`` entry is
token s % page_size of page s // page_size.  ``PagedKVCache.from_token_rows`` views them as pages
without a copy.  Global (dequant) scales are the recipe's per-layer ``k_scales_gpu`` /
``v_scales_gpu``, the numbers SGLang's own NVFP4 writer uses, so every writer and reader agree.

Decode and extend (prefill, chunked prefill, mixed) both run ``ops.paged_attention`` over the
cache after this step's K/V are written into it (bottom-right causal mask).  An eager extend's long
requests take the core's dense prefill where it is offered (``dense_prefill``: SM90 with FlashInfer),
planned once per step and layer feature set on SGLang's host lengths; the prefill kernel otherwise.
CUDA graphs are captured for decode.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from nvfp4_backend import PagedKVCache, ops, planner
from nvfp4_backend.capabilities import decode_supports, kernels_available, unavailable_reason
from nvfp4_backend.dense_prefill import DensePrefill
from nvfp4_backend.dense_prefill import unavailable_reason as dense_unavailable_reason
from nvfp4_backend.modes import KV_MODE_ENV, configured_kv_mode

from . import BACKEND_NAME

log = logging.getLogger("nvfp4_sglang")
DEFAULT_MAX_PREFILL_TOKENS = 16384  # SGLang's own default --max-prefill-tokens


@dataclass
class ForwardMetadata:
    """One step's arguments to ``ops.paged_attention`` (views of preallocated buffers in graphs).

    NOTE: seq_len counts every cache position a request sees this step, its new tokens included;
    its query rows are the last q_len of those positions.
    """
    block_table: torch.Tensor      # [batch, pages] int32 page indices (slot // page_size)
    seq_lens: torch.Tensor         # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32 query row offsets
    max_query_len: int
    plan: planner.AttentionPlan
    workspace: torch.Tensor        # uint8 scratch of at least plan.workspace_bytes
    extend_lens: list[int] | None = None  # an eager extend's host lengths, for the dense prefill
    seq_lens_host: list[int] | None = None
    dense_plans: dict[tuple, planner.AttentionPlan] = field(default_factory=dict)  # per (scale, window, cap)
    plan_inputs: tuple = ()  # plan's (batch, max_query_len, max_seq_len, query_lens): windowed layers replan
    window_plans: dict[int, planner.AttentionPlan] = field(default_factory=dict)


class NVFP4XQABackend(AttentionBackend):
    """Decode + extend over SGLang's NVFP4 token-row pool; MHA/GQA decoder layers only."""

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, MHATokenToKVPool):
            raise NotImplementedError(
                f"{BACKEND_NAME} reads SGLang's MHATokenToKVPool; this model got {type(pool).__name__} "
                "(MLA, hybrid sliding-window and linear-attention pools are not supported)")
        quant = pool.get_kv_cache_quant_method()
        if getattr(quant, "name", None) != "nvfp4":
            raise ValueError(f"{BACKEND_NAME} needs --kv-cache-dtype nvfp4 (pool recipe: "
                             f"{getattr(quant, 'name', type(quant).__name__)!r})")
        if pool.k_scale_buffer is None or pool.v_scale_buffer is None:
            raise RuntimeError(f"the NVFP4 pool allocated no token-linear block scales for {BACKEND_NAME}; "
                               "the plugin's KV access entry was not registered in this process")
        # SGLang's names: layers reach the pools through the active backend (get_token_to_kv_pool()).
        self.token_to_kv_pool, self.req_to_token_pool = pool, model_runner.req_to_token_pool
        self.model_runner = model_runner  # its model's layers say which windows the graphs' plans need
        self.quant = quant
        self.device = torch.device(model_runner.device)
        self.page_size = pool.page_size
        self.req_to_token = self.req_to_token_pool.req_to_token  # [reqs, max_context] int32 slots
        # Column of each page's first token; the widest request needs ceil(width / page_size) pages.
        self.max_num_pages = math.ceil(self.req_to_token.shape[1] / self.page_size)
        self._page_cols = torch.arange(self.max_num_pages, device=self.device) * self.page_size
        cfg = model_runner.model_config
        self.max_context_len = cfg.context_len
        # Largest per-rank GQA group: sizes workspaces before any layer is seen (replicated kv
        # heads under TP only shrink it).
        self.group_bound = max(cfg.num_attention_heads // max(cfg.num_key_value_heads, 1), 1)
        self.num_sms = planner.num_sms(self.device)
        # This backend writes and reads the pool, so the engine uses the one mode read here.
        self.kv_mode = configured_kv_mode()
        log.info("%s: NVFP4 KV mode %r ($%s)", BACKEND_NAME, self.kv_mode.name, KV_MODE_ENV)
        self._caches: dict[int, PagedKVCache] = {}
        server_args = getattr(model_runner, "server_args", None)
        chunk = getattr(server_args, "chunked_prefill_size", None) or -1
        self.max_prefill_tokens = chunk if chunk > 0 else getattr(server_args, "max_prefill_tokens",
                                                                  DEFAULT_MAX_PREFILL_TOKENS)
        self._dense: DensePrefill | None = None  # made at the first long extend: heads and dtype are the layer's
        self._dense_off: str | None = None        # why the dense prefill is off, once decided
        self._workspace = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._graph: dict[int, ForwardMetadata] = {}
        self.forward_metadata = None

    # ------------------------------------------------------------------ planning
    def _plan(self, batch: int, max_query_len: int, max_seq_len: int, query_lens=None,
              sliding_window: int | None = None) -> planner.AttentionPlan:
        """The decode kernel's share of the step (its workspace is bounded by the decode kernel's rows);
        with an extend's host lengths, for the short requests only (longer ones take the prefill
        kernel, which needs no plan)."""
        return planner.plan_attention(batch, self.token_to_kv_pool.head_num, self.group_bound, max_query_len,
                                      max_seq_len, self.token_to_kv_pool.head_dim, self.num_sms,
                                      token_major=True, device=self.device, query_lens=query_lens,  # token rows
                                      sliding_window=sliding_window)

    def _window_plan(self, md: ForwardMetadata, window: int | None) -> planner.AttentionPlan:
        """The step's decode plan for a layer with this window: planned for the positions the window
        lets a request read (SGLang's layers share one metadata, and gpt-oss alternates windowed and
        full layers).  It may need more workspace than the step's plan: an eager step's scratch grows;
        a graph's is sized for the model's windows (init_cuda_graph_state), else the step's plan runs."""
        if window is None or not md.plan_inputs:
            return md.plan
        if window not in md.window_plans:
            plan = self._plan(*md.plan_inputs, sliding_window=window)
            if plan.workspace_bytes > md.workspace.numel():
                capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
                if md.workspace is self._workspace and not capturing:
                    self._workspace = md.workspace = plan.allocate_workspace(self.device)  # eager: grow-only scratch
                else:
                    plan = md.plan
            md.window_plans[window] = plan
        return md.window_plans[window]

    def _layer_windows(self) -> set[int | None]:
        """The windows of the model's attention layers (ours: SGLang's window_left + 1), None for full
        ones; just None before a model is loaded."""
        model = getattr(self.model_runner, "model", None)
        layers = [m for m in model.modules() if isinstance(m, RadixAttention)] if model is not None else []
        return {None} | {m.sliding_window_size + 1 for m in layers if m.sliding_window_size >= 0}

    def _page_table(self, req_pool_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        """[batch, num_pages] int32: page of each request's page-aligned positions (sync-free)."""
        slots = self.req_to_token[req_pool_indices.long()[:, None], self._page_cols[None, :num_pages]]
        return torch.div(slots, self.page_size, rounding_mode="floor").to(torch.int32)

    def init_forward_metadata(self, forward_batch):
        """Eager step (prefill, decode, mixed): plan from the host-side lengths SGLang keeps."""
        fb, mode = forward_batch, forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2() or fb.spec_info is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support speculative decoding ({mode})")
        bs = fb.batch_size
        seq_lens = fb.seq_lens[:bs].to(torch.int32)
        if mode.is_decode_or_idle():
            max_q = 1 if bs else 0
            qsl = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        else:
            max_q = max(fb.extend_seq_lens_cpu, default=0)
            qsl = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens[:bs], 0, dtype=torch.int32), (1, 0))
        max_seq = int(fb.seq_lens_cpu[:bs].max()) if bs else 0
        plan_inputs = (bs, max(max_q, 1), max_seq, None if mode.is_decode_or_idle() else list(fb.extend_seq_lens_cpu[:bs]))
        plan = self._plan(*plan_inputs)
        if self._workspace.numel() < plan.workspace_bytes:  # grow-only scratch
            self._workspace = plan.allocate_workspace(self.device)
        extend = not mode.is_decode_or_idle()
        self.forward_metadata = ForwardMetadata(
            self._page_table(fb.req_pool_indices[:bs], math.ceil(max_seq / self.page_size)),
            seq_lens, qsl, max_q, plan, self._workspace,
            list(fb.extend_seq_lens_cpu[:bs]) if extend else None, fb.seq_lens_cpu[:bs].tolist() if extend else None,
            plan_inputs=plan_inputs)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        dev = self.device
        head_dim = self.token_to_kv_pool.head_dim
        # NOTE: the core's reference fallback plans on the host (a sync), which a graph cannot
        # record; fail at startup with the fix instead of inside SGLang's capture.
        if dev.type == "cuda" and not (kernels_available(dev) and decode_supports(self.group_bound, 1, head_dim)):
            reason = (unavailable_reason(torch.cuda.get_device_capability(dev)) or
                      f"no decode kernel for head_dim={head_dim}, GQA group {self.group_bound}")
            raise RuntimeError(f"{BACKEND_NAME}: decode CUDA graphs need the nvfp4 kernels ({reason}); "
                               "run with --cuda-graph-backend-decode disabled")
        self._graph_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._graph_block_table = torch.zeros(max_bs, self.max_num_pages, dtype=torch.int32, device=dev)
        self._graph_qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)  # one row per request
        # Plans depend on the batch size only (max_seq_len is the context bound), so a captured
        # graph stays valid for any lengths; one workspace serves the largest.
        self._graph_plans = {bs: self._plan(bs, 1, self.max_context_len) for bs in range(1, max_bs + 1)}
        # the windowed layers' plans (_window_plan) may split more than the full layers' one
        windowed = [self._plan(bs, 1, self.max_context_len, sliding_window=window)
                    for bs in range(1, max_bs + 1) for window in self._layer_windows() - {None}]
        need = max(p.workspace_bytes for p in [*self._graph_plans.values(), *windowed])
        self._graph_workspace = torch.empty(max(need, 16), dtype=torch.uint8, device=dev)
        self._graph.clear()

    def get_cuda_graph_seq_len_fill_value(self):
        return 1  # padded requests attend to one (padding-page) token instead of none

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        mode, bs = forward_batch.forward_mode, forward_batch.batch_size
        if not mode.is_decode_or_idle() or forward_batch.spec_info is not None:
            raise NotImplementedError(f"{BACKEND_NAME} captures CUDA graphs for plain decode only, got {mode}; "
                                      "use --cuda-graph-backend-prefill disabled")
        if in_capture:
            self._graph[bs] = ForwardMetadata(
                self._graph_block_table[:bs], self._graph_seq_lens[:bs], self._graph_qsl[:bs + 1], 1,
                self._graph_plans[bs], self._graph_workspace, plan_inputs=(bs, 1, self.max_context_len, None))
        elif bs not in self._graph:
            raise RuntimeError(f"{BACKEND_NAME}: replay of batch size {bs}, which was never captured")
        self.forward_metadata = self._graph[bs]

    def init_forward_metadata_in_graph(self, forward_batch):
        """Recorded into the graph: refresh lengths and page table from the runner's static inputs."""
        md, bs = self.forward_metadata, forward_batch.batch_size
        md.seq_lens.copy_(forward_batch.seq_lens[:bs])
        md.block_table.copy_(self._page_table(forward_batch.req_pool_indices[:bs], self.max_num_pages))

    # ------------------------------------------------------------------ dense prefill
    def _dense_prefill(self, layer, dtype: torch.dtype) -> DensePrefill | None:
        """The core's dense prefill, made at the first long extend; None where it is not offered."""
        if self._dense is None and self._dense_off is None:
            reason = dense_unavailable_reason(self.device)
            if reason is None and self.kv_mode.rotation != "none":
                reason = "a Hadamard KV mode (16-bit rows rotated back would round once more)"
            if reason is None:
                try:
                    self._dense = DensePrefill(self.device, layer.tp_q_head_num, layer.tp_k_head_num,
                                               layer.qk_head_dim, dtype, self.max_prefill_tokens)
                except (TypeError, ValueError) as exc:  # e.g. the workspace cannot hold a step's tokens
                    reason = str(exc)
            self._dense_off = reason or ""
            log.info("%s: %s", BACKEND_NAME, f"prefill on the prefill kernel ({reason})" if reason else
                     f"dense prefill, {self._dense.allocated_bytes / 2**20:.0f} MiB of 16-bit workspace")
        return self._dense

    def _step_plan(self, md: ForwardMetadata, layer, dtype, window: int | None) -> planner.AttentionPlan:
        """The step's plan for this layer: for its window, with the dense prefill for its feature set
        where it applies."""
        plan = self._window_plan(md, window)
        if md.extend_lens is None or self._dense_prefill(layer, dtype) is None:
            return plan
        features = (layer.scaling, window, layer.logit_cap or None)
        if features not in md.dense_plans:  # the first layer of this set in the step plans it
            md.dense_plans[features] = self._dense.plan(plan, md.extend_lens, md.seq_lens_host,
                                                        softmax_scale=layer.scaling, sliding_window=window,
                                                        logits_soft_cap=layer.logit_cap or None)
        return md.dense_plans[features]

    # ------------------------------------------------------------------ forward
    def _cache(self, layer) -> PagedKVCache:
        cache = self._caches.get(layer.layer_id)
        if cache is None:
            if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
                raise NotImplementedError(f"{BACKEND_NAME} serves causal decoder self-attention only, layer "
                                          f"{layer.layer_id} is {layer.attn_type} (cross={layer.is_cross_attention})")
            if layer.qk_head_dim != layer.v_head_dim or layer.qk_head_dim != self.token_to_kv_pool.head_dim:
                raise NotImplementedError(f"{BACKEND_NAME} needs equal K/V head dims matching the pool "
                                          f"({layer.qk_head_dim}, {layer.v_head_dim}, pool {self.token_to_kv_pool.head_dim})")
            if layer.logit_cap and layer.logit_capping_method != "tanh":
                raise NotImplementedError(f"logit capping {layer.logit_capping_method!r} is not supported")
            k, v, k_sf, v_sf = self.token_to_kv_pool.get_raw_kv_buffer(layer.layer_id)
            cache = self._caches[layer.layer_id] = PagedKVCache.from_token_rows(k, k_sf, v, v_sf, self.page_size,
                                                                                  mode=self.kv_mode)
        return cache

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None, **kwargs):
        unknown = sorted(name for name, value in kwargs.items() if value is not None and value is not False)
        if unknown:  # e.g. return_lse, k_rope: silently dropping them would return wrong results
            raise NotImplementedError(f"{BACKEND_NAME} does not support attention arguments {unknown}")
        if not save_kv_cache and self.kv_mode.rotation != "none":
            raise NotImplementedError(f"save_kv_cache=False: K/V stored by another writer are not rotated, and "
                                      f"${KV_MODE_ENV}={self.kv_mode.name} reads a rotated cache")
        cache = self._cache(layer)
        lid = layer.layer_id  # global ids index the recipe's scales (views: no host sync)
        k_g, v_g = self.quant.k_scales_gpu[lid:lid + 1], self.quant.v_scales_gpu[lid:lid + 1]
        if save_kv_cache and k is not None:
            shape = (-1, layer.tp_k_head_num, layer.qk_head_dim)
            ops.write_kv(k.view(shape), v.view(shape), forward_batch.out_cache_loc, cache, k_g, v_g)
        md = self.forward_metadata
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q3.new_empty(q3.shape)
        # SGLang's sliding_window_size is a window_left (HF window - 1); ours counts the query too.
        window = layer.sliding_window_size + 1 if layer.sliding_window_size >= 0 else None
        plan = self._step_plan(md, layer, q3.dtype, window)
        if plan.prefill is not None:  # the dense prefill folds a host K scale into its softmax scale, exactly
            k_g = self.quant.k_scales_float[lid]
        ops.paged_attention(
            q3, cache, md.block_table, md.seq_lens, md.query_start_loc, k_g, v_g, layer.scaling,
            max_query_len=md.max_query_len, sliding_window=window, logits_soft_cap=layer.logit_cap or None,
            sinks=None if sinks is None else sinks.float(),
            out=out, plan=plan, workspace=md.workspace)
        return out.view(-1, layer.tp_q_head_num * layer.qk_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
