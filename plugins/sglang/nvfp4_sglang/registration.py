"""Everything SGLang 0.5.23 must be told about ``nvfp4-xqa``, through its extension points only.

1. the CLI choice (``add_attention_backend_choices``) and the factory registry;
2. the NVFP4 recipe's attention-access registry, so the pool allocates token-linear block
   scales for this backend (without a matching entry it allocates none and the writer drops
   them);
3. two resolution hooks (``register_resolution_hook``) where SGLang's NVFP4 checks name only its
   own backends: ``handle_nvfp4_prefill_kv_dequant_dtype`` and ``handle_kv4_compatibility``.
   Configurations without ``nvfp4-xqa`` go to SGLang's step unchanged.
"""
from __future__ import annotations

import logging

import torch

from . import BACKEND_NAME

log = logging.getLogger("nvfp4_sglang")

DEFAULT_PAGE_SIZE = 64
"""``--page-size`` when the user gives none (SGLang would pick 1): SGLang's trtllm_mha default;
one page-table entry per 64 tokens keeps the decode kernel's page walk short."""
PREFILL_PARTNERS = ("flashinfer",)
"""Prefill backends that read SGLang's NVFP4 pool and can pair with ``nvfp4-xqa`` decode:
FlashInfer through SGLang's FP8 E4M3 dequant workspace."""
MIN_CAPABILITY = (8, 0)
"""Our kernels' floor; the core falls back to its reference elsewhere."""
MIN_CAPABILITY_SGLANG_WRITER = (9, 0)
"""SGLang's own NVFP4 writer (used by the prefill partner) needs SM90, SM100 or SM120."""

_registered = False


def register_all() -> None:
    global _registered
    _register_choice_and_factory()
    _register_kv_access()
    if not _registered:  # resolution hooks append wrappers, so add them once per process
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
        register_resolution_hook("handle_nvfp4_prefill_kv_dequant_dtype")(nvfp4_prefill_hook)
        register_resolution_hook("handle_kv4_compatibility")(kv4_compatibility_hook)
        _registered = True


# ============================================================================ choice + factory
def create_backend(model_runner):
    """Registry factory: ModelRunner -> backend (import deferred to the process that builds it)."""
    from .backend import NVFP4XQABackend
    return NVFP4XQABackend(model_runner)


def _register_choice_and_factory() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])  # a list: the adder is list.extend
    present = ATTENTION_BACKENDS.get(BACKEND_NAME)
    if present is not None and present is not create_backend:
        raise RuntimeError(f"attention backend {BACKEND_NAME!r} is already registered by "
                           f"{present.__module__}.{present.__qualname__}")
    register_attention_backend(BACKEND_NAME)(create_backend)


# ============================================================================ KV access
def _register_kv_access() -> None:
    from sglang.srt.layers.quantization import fp4_kv_cache_quant_method as fp4

    entries = fp4.KV_CACHE_ATTENTION_ACCESS_REGISTRY.get("nvfp4")
    if entries is None:
        raise RuntimeError("SGLang has no 'nvfp4' entry in KV_CACHE_ATTENTION_ACCESS_REGISTRY")
    if not any(BACKEND_NAME in a.backend_matcher.exact for a in entries):
        # NATIVE_FP4: we read packed FP4 + E4M3 scales in place.  Storage uint8 like SGLang's own
        # entries (the pool insists on one storage dtype).  Never PLAIN with a storage dtype:
        # that would make every plain read of the pool dequantize through a method NVFP4 lacks.
        matcher = fp4.KVCacheBackendMatcher(exact=frozenset({BACKEND_NAME}))
        ours = tuple(fp4.KVCacheAttentionAccess(phase, fp4.KVCacheAttentionAccessKind.NATIVE_FP4, matcher,
                                                storage_dtype=torch.uint8,
                                                attention_kv_dtype=getattr(torch, "float4_e2m1fn_x2", None),
                                                scale_recipe="nvfp4")
                     for phase in (fp4.KVCacheAttentionPhase.PREFILL, fp4.KVCacheAttentionPhase.DECODE))
        fp4.KV_CACHE_ATTENTION_ACCESS_REGISTRY["nvfp4"] = tuple(entries) + ours

    # On SM100 a NATIVE_FP4 access gets TRT-LLM GenMHA's swizzled scales instead of the
    # token-linear ones we read; the recipe subclass below keeps linear scales for us.
    current = fp4.KV_CACHE_QUANT_REGISTRY.get("nvfp4")
    if current is fp4.NVFP4KVCacheMethod:
        fp4.KV_CACHE_QUANT_REGISTRY["nvfp4"] = _linear_scale_recipe(fp4)
    elif getattr(current, "_nvfp4_xqa", False) is not True:
        raise RuntimeError(f"KV_CACHE_QUANT_REGISTRY['nvfp4'] is {current!r}, not SGLang's NVFP4KVCacheMethod; "
                           "another plugin replaced the NVFP4 recipe")


def _linear_scale_recipe(fp4):
    class NVFP4XQAKVCacheMethod(fp4.NVFP4KVCacheMethod):
        """SGLang's NVFP4 recipe; token-linear scales whenever ``nvfp4-xqa`` is a selected backend.

        Identical to the parent unless ``nvfp4-xqa`` is selected (configure_attention_backends).
        """
        _nvfp4_xqa = True

        def _xqa_selected(self) -> bool:
            return any(BACKEND_NAME in a.backend_matcher.exact
                       for a in getattr(self, "_active_attention_accesses", ()))

        def needs_linear_scale_buffer(self) -> bool:
            return super().needs_linear_scale_buffer() or self._xqa_selected()

        def needs_native_fp4_scales(self) -> bool:
            # GenMHA's layout only for a selected native reader other than us.
            return self.use_trtllm_gen_native_scale_layout and any(
                a.kind == fp4.KVCacheAttentionAccessKind.NATIVE_FP4 and BACKEND_NAME not in a.backend_matcher.exact
                for a in self.active_attention_accesses())

    NVFP4XQAKVCacheMethod.__module__ = __name__
    return NVFP4XQAKVCacheMethod


# ============================================================================ resolution hooks
def _uses_xqa(cfg) -> bool:
    return BACKEND_NAME in (cfg.attention_backend, cfg.prefill_attention_backend, cfg.decode_attention_backend)


def _split(cfg) -> tuple[str | None, str | None]:
    """(prefill, decode) as SGLang resolves them: the split flags, else --attention-backend."""
    return (cfg.prefill_attention_backend or cfg.attention_backend,
            cfg.decode_attention_backend or cfg.attention_backend)


def nvfp4_prefill_hook(server_args, previous) -> None:
    """``handle_nvfp4_prefill_kv_dequant_dtype``: SGLang's step maps NVFP4 to its own backends
    (FlashInfer FP8 prefill or trtllm_mha, and trtllm_mha decode) and rejects any other name.

    With nvfp4-xqa: ``--attention-backend nvfp4-xqa`` serves both phases from the NVFP4 cache;
    ``--decode-attention-backend nvfp4-xqa`` pairs with FlashInfer prefill through SGLang's FP8
    E4M3 dequant workspace (the default when no prefill backend is given).
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.kv_cache_dtype != "nvfp4" or not _uses_xqa(cfg):
        return previous(server_args)
    prefill, decode = _split(cfg)
    dequant = cfg.prefill_kv_cache_dequant_dtype
    if decode != BACKEND_NAME:
        raise ValueError(f"prefill backend {BACKEND_NAME!r} needs decode backend {BACKEND_NAME!r} too, got "
                         f"{decode!r}; use --attention-backend {BACKEND_NAME}")
    if prefill == BACKEND_NAME:
        if dequant != "auto":
            raise ValueError(f"--prefill-kv-cache-dequant-dtype={dequant} does not apply to --attention-backend "
                             f"{BACKEND_NAME}: it reads the NVFP4 cache directly; leave it at 'auto'")
        declare_resolution(server_args, "nvfp4_xqa", prefill_attention_backend=BACKEND_NAME,
                           decode_attention_backend=BACKEND_NAME)
        return
    if prefill is None:
        prefill = PREFILL_PARTNERS[0]
        log.info("nvfp4-xqa decode: prefill backend not given, using %s with an FP8 E4M3 workspace", prefill)
    if prefill not in PREFILL_PARTNERS:
        raise ValueError(f"--decode-attention-backend {BACKEND_NAME} pairs with prefill backend "
                         f"{' or '.join(PREFILL_PARTNERS + (BACKEND_NAME,))}, got {prefill!r}")
    if dequant not in ("auto", "fp8_e4m3"):
        raise ValueError(f"--prefill-kv-cache-dequant-dtype={dequant} is not served by prefill backend "
                         f"{prefill!r}; use fp8_e4m3 (or auto)")
    declare_resolution(server_args, "nvfp4_xqa", prefill_attention_backend=prefill,
                       decode_attention_backend=BACKEND_NAME, prefill_kv_cache_dequant_dtype="fp8_e4m3")


def kv4_compatibility_hook(server_args, previous) -> None:
    """``handle_kv4_compatibility``: SGLang's step allows a single NVFP4 backend only from a fixed
    list and only on SM100/SM120.  For nvfp4-xqa it is replaced by the checks that hold for us;
    it also rejects nvfp4-xqa without an NVFP4 cache and sets the page-size default."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, declare_resolution, resolved_view
    from sglang.srt.runtime_context import get_platform

    view = resolved_view(server_args)
    prefill, decode = attention_backends_of(view)
    if BACKEND_NAME not in (prefill, decode):
        return previous(server_args)
    if view.kv_cache_dtype != "nvfp4":
        raise ValueError(f"attention backend {BACKEND_NAME!r} reads an NVFP4 KV cache; add --kv-cache-dtype "
                         f"nvfp4 (got --kv-cache-dtype {view.kv_cache_dtype})")
    platform = get_platform()
    if not platform.is_cuda:
        raise RuntimeError(f"attention backend {BACKEND_NAME!r} needs a CUDA GPU")
    need = MIN_CAPABILITY if prefill == decode else MIN_CAPABILITY_SGLANG_WRITER
    cap = tuple(platform.device_capability)
    if cap < need:
        raise RuntimeError(f"attention backend {BACKEND_NAME!r} with prefill backend {prefill!r} needs compute "
                           f"capability >= {need[0]}.{need[1]}, this GPU has {cap[0]}.{cap[1]}")
    if view.enable_unified_memory:
        raise ValueError(f"--enable-unified-memory is not supported with {BACKEND_NAME}: the unified pool "
                         "allocates no FP4 block scales")
    if view.speculative_algorithm is not None:
        raise ValueError(f"speculative decoding ({view.speculative_algorithm}) is not supported by "
                         f"{BACKEND_NAME} yet (no target-verify / draft-extend path)")
    if prefill != decode:
        from nvfp4_backend.modes import KV_MODE_ENV, configured_kv_mode
        mode = configured_kv_mode()
        if mode.rotation != "none":
            # the prefill backend writes and reads unrotated K/V with SGLang's own quantizer
            raise ValueError(f"${KV_MODE_ENV}={mode.name} rotates the cache, which prefill backend {prefill!r} "
                             f"would write and read unrotated; use --attention-backend {BACKEND_NAME} for both "
                             f"phases, or a mode without rotation ('plain' or '6or4')")
    if view.page_size is None:
        declare_resolution(server_args, "nvfp4_xqa", page_size=DEFAULT_PAGE_SIZE)
    elif view.page_size <= 0 or view.page_size & (view.page_size - 1):
        # The decode kernel finds a position's page by shifting (csrc/binding.cpp: log2_exact).
        raise ValueError(f"{BACKEND_NAME} needs a power-of-two --page-size, got {view.page_size}")
