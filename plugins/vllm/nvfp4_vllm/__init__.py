"""vLLM plugin: this project's NVFP4 KV-cache attention as a vLLM attention backend.

Two entry points:

* ``register`` (``vllm.general_plugins``), loaded by vLLM in every process (API server, engine
  core, workers, ``EngineArgs``).  It registers one backend class under two names:

  - ``CUSTOM`` (``--attention-backend CUSTOM``), a static member of vLLM's enum;
  - ``NVFP4_XQA`` (``--attention-backend nvfp4_xqa``; vLLM upper-cases the flag value), added as
    another name of the ``CUSTOM`` member, so a config that selects it holds ``CUSTOM``.  A
    ``spawn``-ed engine core or worker unpickles its config before it loads plugins, and only a
    static member exists there at that time.

  On vLLM's CPU platform it also makes ``CPU_ATTN`` refuse an NVFP4 cache (see ``cpu_guard``).

* ``platform_plugin`` (``vllm.platform_plugins``): with ``NVFP4_BACKEND_VLLM_CPU=1``, vLLM's CPU
  platform honours an explicitly selected NVFP4 backend, which it otherwise ignores.

NOTE: ``--attention-backend nvfp4-xqa`` (hyphen) does not work.  vLLM resolves the flag with
``AttentionBackendEnum[value.upper()]`` and its ``register`` accepts only Python identifiers.

The module imports nothing from vLLM at import time, so a broken vLLM never fails the entry-point
load silently (vLLM logs and swallows import errors there); ``register`` raises instead.
"""
from __future__ import annotations

import logging
import os

__all__ = ["register", "platform_plugin", "BACKEND_NAME", "BACKEND_CLASS_PATH", "CPU_PLATFORM_ENV"]

BACKEND_NAME = "NVFP4_XQA"
BACKEND_CLASS_PATH = "nvfp4_vllm.backend.Nvfp4XqaBackend"
KV_CACHE_DTYPE = "nvfp4"
# vLLM's name for the same bytes with each block's scale chosen between max/6 and max/4 by squared
# error (vLLM serves it on SM100 only); here it selects the core's "6or4" scale rule on SM80+.
KV_CACHE_DTYPE_4OVER6 = "nvfp4_4over6"
NVFP4_CACHE_DTYPES = (KV_CACHE_DTYPE, KV_CACHE_DTYPE_4OVER6)

CPU_PLATFORM_ENV = "NVFP4_BACKEND_VLLM_CPU"
CPU_PLATFORM_CLASS_PATH = "nvfp4_vllm.cpu_platform.Nvfp4CpuPlatform"
CPU_ATTN_GUARD_CLASS_PATH = "nvfp4_vllm.cpu_guard.CpuAttentionRefusingNvfp4"

# Inside vLLM's "vllm" logger tree: vLLM configures only that tree (its own handler, propagate
# off), so a record from any other logger below WARNING is dropped.
log = logging.getLogger("vllm.nvfp4_vllm")


class IncompatibleVllmError(RuntimeError):
    """The installed vLLM lacks an interface this backend is written against (0.32 / 0.33)."""


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise IncompatibleVllmError(
            f"nvfp4_vllm: the installed vLLM lacks {what}; this plugin needs vLLM 0.32 or 0.33 "
            f"(uninstall nvfp4-backend's vLLM plugin or install a supported vLLM)")


def _check_vllm_interface() -> None:
    """Fail at registration, not at the first request, when a needed vLLM API is missing."""
    try:
        import vllm
        from vllm.config import cache as cache_cfg
        from vllm.v1.attention import backend as vbackend
        from vllm.v1.attention.backends import registry, utils as vutils
        from vllm.v1 import kv_cache_interface as kvi
    except ImportError as exc:
        raise IncompatibleVllmError(f"nvfp4_vllm: cannot import vLLM's v1 attention API ({exc}); "
                                    f"this plugin needs vLLM 0.32 or 0.33") from exc
    version = getattr(vllm, "__version__", "unknown")
    _require(hasattr(registry, "register_backend") and hasattr(registry.AttentionBackendEnum, "CUSTOM"),
             f"register_backend / AttentionBackendEnum.CUSTOM (vLLM {version})")
    known = getattr(cache_cfg, "KV_CACHE_DTYPES", None)  # 0.33: mutable list; 0.32: the Literal only
    if known is None:
        from typing import get_args
        known = get_args(cache_cfg.CacheDType)
    _require(KV_CACHE_DTYPE in known, f"the '{KV_CACHE_DTYPE}' KV-cache dtype (vLLM {version})")
    for name in ("customize_spec", "supported_kv_cache_layouts", "validate_configuration"):
        _require(hasattr(vbackend.AttentionBackend, name), f"AttentionBackend.{name} (vLLM {version})")
    _require(hasattr(vbackend, "AttentionCGSupport") and hasattr(vbackend, "CommonAttentionMetadata"),
             f"AttentionCGSupport / CommonAttentionMetadata (vLLM {version})")
    _require(hasattr(vutils, "split_decodes_and_prefills"), f"split_decodes_and_prefills (vLLM {version})")
    fields = getattr(kvi.AttentionSpec, "__dataclass_fields__", {})
    _require("num_head_slots" in fields and "state_content_bytes" in fields,
             f"AttentionSpec.num_head_slots / state_content_bytes (vLLM {version})")
    _require(hasattr(kvi, "KVCacheLayout"), f"KVCacheLayout (vLLM {version})")


def register() -> None:
    """Register the backend as ``CUSTOM`` and ``NVFP4_XQA``; safe to call any number of times."""
    _check_vllm_interface()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden():
        register_backend(custom, BACKEND_CLASS_PATH)
    custom_is_ours = custom.get_path() == BACKEND_CLASS_PATH

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None and custom_is_ours:
        # Another name for the CUSTOM member, not a member of its own: a config selecting it
        # pickles as CUSTOM, which a spawned process can unpickle before it loads this plugin.
        # Enum aliases live in _member_map_; Python 3.11 has no public call that adds one.
        AttentionBackendEnum._member_map_[BACKEND_NAME] = custom
    elif member is None:
        # Another plugin owns CUSTOM; taking it over would silently change what that plugin's
        # users get.  Ours stays reachable by name, as a member of its own.
        log.warning("nvfp4_vllm: --attention-backend CUSTOM is already registered to %s; use "
                    "--attention-backend nvfp4_xqa for the NVFP4 backend (it cannot start a spawned "
                    "engine or worker process: those need CUSTOM)", custom.get_path())
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    elif member.get_path() != BACKEND_CLASS_PATH:
        raise IncompatibleVllmError(
            f"nvfp4_vllm: attention backend {BACKEND_NAME} is already registered to {member.get_path()}; "
            f"two plugins claim the name (restrict them with VLLM_PLUGINS)")

    if current_platform.is_cpu():
        _guard_cpu_attention(AttentionBackendEnum.CPU_ATTN, register_backend)


def _guard_cpu_attention(cpu_attn, register_backend) -> None:
    """CPU_ATTN reads an NVFP4 cache as FP8; make it refuse one at startup instead."""
    if not cpu_attn.is_overridden():
        register_backend(cpu_attn, CPU_ATTN_GUARD_CLASS_PATH)
    elif cpu_attn.get_path() != CPU_ATTN_GUARD_CLASS_PATH:
        log.warning("nvfp4_vllm: CPU_ATTN is registered to %s, so nothing stops it from reading an "
                    "NVFP4 KV cache it cannot decode", cpu_attn.get_path())


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` hook: this plugin's CPU platform where it is asked for and applies.

    Active only with ``NVFP4_BACKEND_VLLM_CPU=1`` and where vLLM itself would pick its stock
    ``CpuPlatform``; otherwise ``None``, which leaves vLLM's platform choice as it is.
    """
    if os.environ.get(CPU_PLATFORM_ENV, "") != "1":
        return None
    from vllm import platforms
    if platforms.cpu_platform_plugin() != "vllm.platforms.cpu.CpuPlatform":
        return None
    return CPU_PLATFORM_CLASS_PATH
