"""``CPU_ATTN`` that refuses an NVFP4 KV cache, registered over ``CPU_ATTN`` on CPU platforms.

vLLM's CPU attention reads the uint8 NVFP4 pages as FP8: garbage text on CPUs with AVX-512, with
nothing in the log but ``Cannot use AttentionBackendEnum.CUSTOM backend on CPU`` (an FP8 error on
CPUs without it).  This subclass is ``CPU_ATTN`` unchanged, except that building an attention
layer over an NVFP4 cache stops the engine at model construction, before any request, with the
reason and the fix.
"""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import CPU_PLATFORM_ENV, NVFP4_CACHE_DTYPES
from .cpu_platform import cpu_path_active


def refusal_reason(kv_cache_dtype: str) -> str:
    why = (f"nvfp4_vllm: vLLM's CPU attention (CPU_ATTN) cannot read the {kv_cache_dtype!r} KV cache "
           f"(it would read the NVFP4 bytes as FP8)")
    if cpu_path_active():
        return f"{why}; select the NVFP4 backend: --attention-backend CUSTOM"
    return (f"{why}; vLLM's stock CPU platform ignores --attention-backend. To run the NVFP4 backend on a "
            f"CPU, set {CPU_PLATFORM_ENV}=1 (with VLLM_TARGET_DEVICE unset: vLLM skips platform plugins "
            f"when it is 'cpu') and pass --attention-backend CUSTOM; or drop --kv-cache-dtype {kv_cache_dtype}")


class CpuAttentionImplRefusingNvfp4(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, *args, **kwargs) -> None:
        if kv_cache_dtype in NVFP4_CACHE_DTYPES:
            raise ValueError(refusal_reason(kv_cache_dtype))
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, *args, **kwargs)


class CpuAttentionRefusingNvfp4(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CpuAttentionImplRefusingNvfp4]:
        return CpuAttentionImplRefusingNvfp4
