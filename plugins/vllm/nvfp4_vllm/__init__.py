"""vLLM plugin: this project's NVFP4 KV-cache attention as a vLLM attention backend.

vLLM loads ``register`` from the ``vllm.general_plugins`` entry point in every process (API
server, engine core, workers, ``EngineArgs``).  It registers one backend class under two names:

* ``CUSTOM`` (``--attention-backend CUSTOM``): a static member of vLLM's enum, so it also
  survives pickling into ``spawn``-ed engine/worker processes, which unpickle the config before
  they load plugins.
* ``NVFP4_XQA`` (``--attention-backend nvfp4_xqa``; vLLM upper-cases the flag value).

NOTE: ``--attention-backend nvfp4-xqa`` (hyphen) cannot work without patching vLLM internals.
vLLM resolves the flag with ``AttentionBackendEnum[value.upper()]`` and
``AttentionBackendEnum.register`` only accepts Python identifiers ("Invalid or reserved backend
name"); the only way in would be writing into the enum's private ``_member_map_``.

The module imports nothing from vLLM at import time, so a broken vLLM never fails the entry-point
load silently (vLLM logs and swallows import errors there); ``register`` raises instead.
"""
from __future__ import annotations

import logging

__all__ = ["register", "BACKEND_NAME", "BACKEND_CLASS_PATH"]

BACKEND_NAME = "NVFP4_XQA"
BACKEND_CLASS_PATH = "nvfp4_vllm.backend.Nvfp4XqaBackend"
KV_CACHE_DTYPE = "nvfp4"
# vLLM's name for the same bytes with each block's scale chosen between max/6 and max/4 by squared
# error (vLLM serves it on SM100 only); here it selects the core's "6or4" scale rule on SM80+.
KV_CACHE_DTYPE_4OVER6 = "nvfp4_4over6"

log = logging.getLogger("nvfp4_vllm")


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
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if not custom.is_overridden():
        register_backend(custom, BACKEND_CLASS_PATH)
    elif custom.get_path() != BACKEND_CLASS_PATH:
        # Another plugin owns CUSTOM; taking it over would silently change what that plugin's
        # users get.  Ours stays reachable by name.
        log.warning("nvfp4_vllm: --attention-backend CUSTOM is already registered to %s; "
                    "use --attention-backend nvfp4_xqa for the NVFP4 backend", custom.get_path())

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    elif member.get_path() != BACKEND_CLASS_PATH:
        raise IncompatibleVllmError(
            f"nvfp4_vllm: attention backend {BACKEND_NAME} is already registered to {member.get_path()}; "
            f"two plugins claim the name (restrict them with VLLM_PLUGINS)")
