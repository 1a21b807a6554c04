"""NVFP4 KV-cache attention for vLLM, served by nvfp4_backend's ops.

Three classes, as in vLLM's triton_attn.py:
  * ``Nvfp4XqaBackend`` declares what the kernels support, as data, so vLLM's
    ``validate_configuration`` rejects everything else with a reason;
  * ``Nvfp4XqaMetadataBuilder`` splits each step into decode and prefill rows and plans both on
    the host (split-KV count, workspace), once per step, outside CUDA graphs;
  * ``Nvfp4XqaImpl`` quantizes K/V into the cache on write and runs paged attention.
All numerics (format, layout, kernels, reference) live in ``nvfp4_backend``; nothing here
touches a byte of the cache itself.

The page is vLLM's inline NVFP4 page (the one its FlashInfer fa2 path uses): per page
``[K data | K scales | V data | V scales]``, 2 * num_kv_heads head slots of D/2 + D/16 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers, split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, KVQuantMode

from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from nvfp4_backend import PagedKVCache, ops, planner
from nvfp4_backend import format as fmt
from nvfp4_backend.capabilities import SUPPORTED_HEAD_DIMS, decode_query_len, decode_supports, kernels_available, \
    kernels_serve_any_batch, unavailable_reason
from nvfp4_backend.modes import KV_MODE_ENV, configured_kv_mode

from . import BACKEND_NAME, CPU_PLATFORM_ENV, KV_CACHE_DTYPE, KV_CACHE_DTYPE_4OVER6
from .dense import dense_prefill_for

HEAD_SIZES = list(SUPPORTED_HEAD_DIMS)
BLOCK_SIZES = [16, 32, 64, 128]
MIN_CAPABILITY = (8, 0)  # the kernels use SM80 mma.sync (bf16/fp16)

# Under vLLM's "vllm" logger: vLLM configures only that tree, so an INFO line elsewhere is dropped.
logger = init_logger(f"vllm.{__name__}")


class Nvfp4XqaBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [KV_CACHE_DTYPE, KV_CACHE_DTYPE_4OVER6]
    # vLLM calls do_kv_cache_update (quantize-on-write) before forward.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[Nvfp4XqaImpl]:
        return Nvfp4XqaImpl

    @staticmethod
    def get_builder_cls() -> type[Nvfp4XqaMetadataBuilder]:
        return Nvfp4XqaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return list(BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        if capability is None:  # no CUDA device: only where nvfp4_vllm's CPU platform serves it
            from .cpu_platform import cpu_path_active
            return cpu_path_active()
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Page-dense layouts only: the inline page is cut into [K data | K sf | V data | V sf]
        # by byte offsets, which needs each page's bytes in one run.  Head-major first: a
        # decode thread block serves one kv head, whose tokens are then contiguous.
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Size pages as NVFP4 data + E4M3 scales (0.5625 B/element), K then V inline."""
        if spec.state_content_bytes is not None:  # already ours (vLLM may apply it twice)
            return spec
        if spec.kv_quant_mode != KVQuantMode.NVFP4:
            raise ValueError(f"{BACKEND_NAME} stores an NVFP4 cache only, got kv_quant_mode "
                             f"{spec.kv_quant_mode.name}; pass --kv-cache-dtype {KV_CACHE_DTYPE}")
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"{BACKEND_NAME} needs equal K/V head sizes, got head_size={spec.head_size}, "
                             f"head_size_v={spec.head_size_v}")
        assert spec.dtype == torch.uint8, spec.dtype  # vLLM's storage dtype for "nvfp4": bytes
        return replace(spec, num_head_slots=2 * spec.num_kv_heads,
                       state_content_bytes=fmt.bytes_per_token_head(spec.head_size))

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                               use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
                               **kwargs) -> list[str]:
        reasons = super().validate_configuration(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales, device_capability=device_capability,
            attn_type=attn_type, **kwargs)
        # vLLM's generic reasons name the field but not the value or the supported set.
        detail = {
            "head_size not supported": f"head_size {head_size} is not one of {HEAD_SIZES}",
            "dtype not supported": f"dtype {dtype} is not float16 or bfloat16",
            "kv_cache_dtype not supported": f"kv_cache_dtype {kv_cache_dtype!r} is not one of "
                                            f"{cls.supported_kv_cache_dtypes} (pass --kv-cache-dtype {KV_CACHE_DTYPE})",
            "block_size not supported": f"block_size {block_size} is not a multiple of one of {BLOCK_SIZES}",
            "compute capability not supported": (
                f"compute capability {device_capability} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
                if device_capability is not None else
                f"no CUDA device; on vLLM's CPU platform set {CPU_PLATFORM_ENV}=1 (nvfp4_vllm's CPU platform)"),
        }
        return [detail.get(r, r) for r in reasons]


@dataclass
class Nvfp4AttentionCall:
    """One ``ops.paged_attention`` call over query rows ``[token_start, token_end)``."""
    token_start: int
    token_end: int
    query_start_loc: torch.Tensor  # [reqs + 1] int32, rebased to token_start
    seq_lens: torch.Tensor          # [reqs] int32
    block_table: torch.Tensor       # [reqs, max_pages] int32
    max_query_len: int
    plan: planner.AttentionPlan
    # per layer features (scale, window, soft cap): the plan with the dense prefill, where planned
    dense_plans: dict[tuple, planner.AttentionPlan] = field(default_factory=dict)


@dataclass
class Nvfp4XqaMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    decode: Nvfp4AttentionCall | None  # q_len <= reorder threshold: the paged decode kernel
    prefill: Nvfp4AttentionCall | None  # longer queries: the core picks kernel or dense path
    workspace: torch.Tensor


class Nvfp4XqaMetadataBuilder(AttentionMetadataBuilder[Nvfp4XqaMetadata]):
    # FULL graphs for any batch, mixed ones included (get_cudagraph_support narrows it by shape).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        num_heads = get_num_attention_heads_from_layers(vllm_config, layer_names) or \
            model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.group_size = num_heads // self.num_kv_heads
        self.max_model_len = model_config.max_model_len
        # Spec-decode verification rows (1 + k tokens) count as decodes.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        if torch.device(device).type == "cuda" and vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs() \
                and not kernels_available(torch.device(device)):
            # The reference fallback syncs with the host, which a CUDA graph capture cannot hold.
            raise RuntimeError(f"{BACKEND_NAME}: the CUDA kernels are unavailable on {device} "
                               f"({unavailable_reason(torch.cuda.get_device_capability(device))}); full CUDA "
                               f"graphs need them: fix the build or run with --enforce-eager")
        self.num_sms = planner.num_sms(device)
        # The layout the engine core resolved (unset in tools and tests: then our first choice, head-major).
        layout = vllm_config.cache_config.kv_cache_layout
        self.token_major = layout is not None and KVCacheLayout[layout] in (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        # The decode plan serves every layer of the group: planned for the tokens their window lets a
        # request read where they share one (vLLM's hybrid KV manager groups windowed layers apart).
        windows = {layer.impl.sliding_window for layer in layers.values()}
        self.sliding_window = windows.pop() if len(windows) == 1 else None
        # NOTE: one workspace for every step and every captured graph, sized for the worst plan
        # any step can make: up to max_num_seqs requests, the longest query the kernel serves,
        # max_model_len tokens.  Plans are host-side and graph-baked, so it must never move.
        self.decode_query_len = decode_query_len(self.group_size, self.head_size)
        plans = [self._plan(b, self.decode_query_len, self.max_model_len)
                 for b in range(1, vllm_config.scheduler_config.max_num_seqs + 1)] if self.decode_query_len else []
        worst = max(plans, key=lambda p: p.workspace_bytes, default=planner.AttentionPlan(1, 0))
        self.workspace = worst.allocate_workspace(device)
        self.dense, self.dense_features = self._dense_prefill(vllm_config, layers, torch.device(device))

    def _dense_prefill(self, vllm_config, layers: dict, device: torch.device):
        """The engine's dense prefill for this group's long requests (made in vLLM's profiling run,
        ``dense``), with the layers' distinct (scale, window, soft cap) (each planned per step);
        (None, None) where it does not apply, and the prefill kernel serves them."""
        dense, _ = dense_prefill_for(device, self.group_size * self.num_kv_heads, self.num_kv_heads, self.head_size,
                                     vllm_config.model_config.dtype, vllm_config.scheduler_config.max_num_batched_tokens,
                                     vllm_config.model_config.max_model_len)
        if dense is None:
            return None, None
        return dense, sorted({layer.impl.dense_features for layer in layers.values()}, key=str)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # One call serves any mix without the host (the decode kernel, then the prefill kernel for longer
        # requests: tests/gpu/test_extend.py replays such a graph with new lengths), so FULL graphs hold
        # mixed batches too (build_for_cudagraph_capture); shapes the kernels do not serve get none.
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        group = heads // kv_cache_spec.num_kv_heads
        if kernels_serve_any_batch(group, kv_cache_spec.head_size):
            return AttentionCGSupport.ALWAYS
        return AttentionCGSupport.NEVER

    def _plan(self, batch: int, max_query_len: int, max_seq_len: int) -> planner.AttentionPlan:
        if not decode_supports(self.group_size, max_query_len, self.head_size):
            return planner.AttentionPlan(num_splits=1, workspace_bytes=0)  # the prefill kernel needs no plan
        return planner.plan_attention(batch, self.num_kv_heads, self.group_size, max_query_len, max_seq_len,
                                      self.head_size, self.num_sms, token_major=self.token_major, device=self.device,
                                      sliding_window=self.sliding_window)

    def _call(self, cm: CommonAttentionMetadata, reqs: tuple[int, int], tokens: tuple[int, int],
              max_query_len: int, max_seq_len: int, plan_query_len: int | None = None) -> Nvfp4AttentionCall:
        """A call over requests ``reqs`` and query rows ``tokens``; its decode plan is made for
        ``plan_query_len`` (default ``max_query_len``) tokens per request."""
        (r0, r1), (t0, t1) = reqs, tokens
        qsl = cm.query_start_loc[r0:r1 + 1]
        plan = self._plan(r1 - r0, max_query_len if plan_query_len is None else plan_query_len, max_seq_len)
        if plan.workspace_bytes > self.workspace.numel():
            raise RuntimeError(f"{BACKEND_NAME}: plan needs {plan.workspace_bytes} workspace bytes, "
                               f"{self.workspace.numel()} were preallocated (max_num_seqs / max_model_len changed?)")
        return Nvfp4AttentionCall(t0, t1, qsl - t0 if t0 else qsl, cm.seq_lens[r0:r1],
                                  cm.block_table_tensor[r0:r1], max_query_len, plan)

    def _dense_plan(self, cm: CommonAttentionMetadata, call: Nvfp4AttentionCall, reqs: tuple[int, int]) -> None:
        """Plan the dense prefill into ``call`` from the host lengths vLLM keeps (exact on prefill rows)."""
        if cm.seq_lens_cpu_upper_bound is None:
            return  # no host lengths: reading the device's would synchronize
        r0, r1 = reqs
        qsl = cm.query_start_loc_cpu[r0:r1 + 1]
        query_lens, seq_lens = (qsl[1:] - qsl[:-1]).tolist(), cm.seq_lens_cpu_upper_bound[r0:r1].tolist()
        for features in self.dense_features:
            scale, window, soft_cap = features
            call.dense_plans[features] = self.dense.plan(call.plan, query_lens, seq_lens, softmax_scale=scale,
                                                         sliding_window=window, logits_soft_cap=soft_cap)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False, max_seq_len: int | None = None, capturing: bool = False) -> Nvfp4XqaMetadata:
        cm = common_attn_metadata
        max_seq_len = cm.max_seq_len if max_seq_len is None else max_seq_len
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold)
        decode = prefill = None
        if num_decodes:
            decode = self._call(cm, (0, num_decodes), (0, num_decode_tokens),
                                min(cm.max_query_len, self.reorder_batch_threshold), max_seq_len)
        if num_prefills:
            prefill = self._call(cm, (num_decodes, num_decodes + num_prefills),
                                 (num_decode_tokens, num_decode_tokens + num_prefill_tokens),
                                 cm.max_query_len, max_seq_len)
            if self.dense is not None and not capturing:  # the dense kernel's plans live outside graphs
                self._dense_plan(cm, prefill, (num_decodes, num_decodes + num_prefills))
        return Nvfp4XqaMetadata(cm.num_actual_tokens, cm.slot_mapping, decode, prefill, self.workspace)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> Nvfp4XqaMetadata:
        # NOTE: the split-KV count is baked into the captured graph, so plan for the longest
        # sequence the graph may ever replay, not for the dummy lengths of the capture batch.
        cm = common_attn_metadata
        if cm.max_query_len <= self.reorder_batch_threshold:  # a uniform decode graph: decode rows only
            return self.build(0, cm, max_seq_len=self.max_model_len, capturing=True)
        # A mixed batch's graph (cudagraph_mode FULL): vLLM captures it on a dummy batch whose
        # max_query_len is its token count (its requests may all look like decodes) and replays it for
        # any mix written into the same buffers.  So one call over every request and token, on views of
        # those buffers: the decode kernel, planned for the longest context, then the prefill kernel,
        # which max_query_len puts in the graph and which finds the long requests on the device.
        call = self._call(cm, (0, cm.num_reqs), (0, cm.num_actual_tokens), cm.max_query_len, self.max_model_len,
                          plan_query_len=min(cm.max_query_len, self.decode_query_len))
        return Nvfp4XqaMetadata(cm.num_actual_tokens, cm.slot_mapping, None, call, self.workspace)


class Nvfp4XqaImpl(AttentionImpl[Nvfp4XqaMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **unsupported) -> None:
        unsupported = {k: v for k, v in unsupported.items() if v not in (None, False, -1)}
        if unsupported:
            raise NotImplementedError(f"{BACKEND_NAME} does not support {sorted(unsupported)}")
        if alibi_slopes is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support ALiBi (alibi_slopes)")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} supports decoder self-attention only, got attn_type={attn_type}")
        if kv_cache_dtype not in Nvfp4XqaBackend.supported_kv_cache_dtypes:
            raise ValueError(f"{BACKEND_NAME} reads an NVFP4 cache only, got kv_cache_dtype={kv_cache_dtype!r}; "
                             f"pass --kv-cache-dtype {KV_CACHE_DTYPE} (or {KV_CACHE_DTYPE_4OVER6})")
        if head_size not in HEAD_SIZES:
            raise ValueError(f"{BACKEND_NAME}: head_size {head_size} is not one of {HEAD_SIZES}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        # vLLM's window W (flash-attn's (W-1, 0)) is ours: a query at p sees p-W+1..p.
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape [num_heads={num_heads}], got {tuple(sinks.shape)}")
        self.sinks = sinks
        self.dense_features = (self.scale, self.sliding_window, self.logits_soft_cap)  # the builder plans each set
        vllm_config = get_current_vllm_config_or_none()  # vLLM makes the impl under its config; tools may not
        self.dense_shape = None if vllm_config is None else (
            self.num_heads, self.num_kv_heads, head_size, vllm_config.model_config.dtype,
            vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len)
        # This backend both writes and reads the cache, so every layer of the engine uses the one
        # mode read here (the process environment), never a cache written with another.
        self.kv_mode = configured_kv_mode()
        if kv_cache_dtype == KV_CACHE_DTYPE_4OVER6:
            self.kv_mode = replace(self.kv_mode, scale_rule="6or4")
        logger.info_once(f"{BACKEND_NAME}: NVFP4 KV mode {self.kv_mode.name!r} (${KV_MODE_ENV}, "
                         f"--kv-cache-dtype {kv_cache_dtype})")
        self._cache_key: tuple | None = None
        self._cache: PagedKVCache | None = None

    def _paged_cache(self, kv_cache: torch.Tensor) -> PagedKVCache:
        """vLLM's [num_blocks, 2 * kv_heads, block_size, D/2 + D/16] uint8 view as a PagedKVCache."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride())
        if key != self._cache_key:  # views are rebuilt only when vLLM rebinds the cache
            num_blocks, slots, block_size, content = kv_cache.shape
            # The same test as vLLM's flashinfer._nvfp4_kv_views: head-major (HND) or token-major
            # (NHD) dense pages; anything else would interleave other layers' bytes into a page.
            hnd = kv_cache.stride()[1:] == (block_size * content, content, 1)
            if not hnd and kv_cache.stride()[1:] != (content, slots * content, 1):
                raise ValueError(f"{BACKEND_NAME}: KV pages must be dense (HND or NHD), got shape "
                                 f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
            if slots != 2 * self.num_kv_heads or content != fmt.bytes_per_token_head(self.head_size):
                raise ValueError(f"{BACKEND_NAME}: kv_cache shape {tuple(kv_cache.shape)} is not "
                                 f"[blocks, 2 * {self.num_kv_heads}, block_size, "
                                 f"{fmt.bytes_per_token_head(self.head_size)}] (customize_spec not applied?)")
            # NHD pages are dense but permuted ([2H, N, C] strides (C, 2H*C, 1)); hand the core the
            # same bytes as a page-contiguous [B, N, 2H, C] view, which it accepts.
            pages = kv_cache if hnd else kv_cache.transpose(1, 2)
            self._cache = PagedKVCache.from_inline_pages(pages, block_size, self.num_kv_heads, self.head_size,
                                                         head_major=hnd, mode=self.kv_mode)
            self._cache_key = key
        return self._cache

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # the target layer wrote this cache
        # key/value may be padded past slot_mapping (CUDA-graph padding); slots < 0 are skipped.
        n = slot_mapping.shape[0]
        ops.write_kv(key[:n], value[:n], slot_mapping, self._paged_cache(kv_cache), layer._k_scale, layer._v_scale)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Nvfp4XqaMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support fused output quantization")
        if attn_metadata is None:  # profiling run: no cache yet; its peak memory counts the dense prefill
            if self.dense_shape is not None:
                dense_prefill_for(query.device, *self.dense_shape, profiling=True)
            return output.fill_(0)
        cache = self._paged_cache(kv_cache)
        sinks = None if self.sinks is None else self.sinks.float()
        for call in (attn_metadata.decode, attn_metadata.prefill):
            if call is None:
                continue
            rows = slice(call.token_start, call.token_end)
            plan = call.dense_plans.get(self.dense_features, call.plan)
            # the dense prefill folds a host K scale into its softmax scale, exactly (kernels.md#dense-prefill)
            k_scale = layer._k_scale if plan.prefill is None else layer._k_scale_float
            ops.paged_attention(query[rows], cache, call.block_table, call.seq_lens, call.query_start_loc,
                                k_scale, layer._v_scale, self.scale, max_query_len=call.max_query_len,
                                sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                                sinks=sinks, out=output[rows], plan=plan, workspace=attn_metadata.workspace)
        return output
