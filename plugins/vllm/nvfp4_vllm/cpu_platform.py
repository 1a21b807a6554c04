"""``Nvfp4CpuPlatform``: vLLM's CPU platform, honouring an explicitly selected NVFP4 backend.

vLLM's ``CpuPlatform.get_attn_backend_cls`` returns ``CPU_ATTN`` for every non-MLA model, whatever
``--attention-backend`` says, and never validates the selection.  This subclass (the
``vllm.platform_plugins`` entry point ``nvfp4_vllm:platform_plugin``, opt-in by
``NVFP4_BACKEND_VLLM_CPU=1``) serves the NVFP4 backend where it is selected, after
``validate_configuration``, as vLLM's CUDA platform does.  Everything else is ``CpuPlatform``'s.

vLLM imports this module while it resolves ``current_platform``, so it imports nothing that needs
``current_platform`` at import time.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from . import BACKEND_CLASS_PATH, CPU_PLATFORM_ENV

logger = init_logger(f"vllm.{__name__}")


def cpu_path_active() -> bool:
    """Whether this process runs on ``Nvfp4CpuPlatform``, where the backend serves CPU tensors."""
    import vllm.platforms
    return isinstance(vllm.platforms.current_platform, Nvfp4CpuPlatform)


def _selects_nvfp4_backend(selected_backend) -> bool:
    if selected_backend is None:
        return False
    try:
        return selected_backend.get_path() == BACKEND_CLASS_PATH
    except ValueError:  # CUSTOM without a registration
        return False


class Nvfp4CpuPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if not _selects_nvfp4_backend(selected_backend):
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        backend = selected_backend.get_class()
        reasons = backend.validate_configuration(device_capability=cls.get_device_capability(),
                                                 **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend.name} ({backend.get_name()}) is not valid "
                             f"for this configuration. Reason: {reasons}")
        logger.info_once("Using %s backend on the CPU (%s=1).", backend.get_name(), CPU_PLATFORM_ENV)
        return BACKEND_CLASS_PATH
