"""nvfp4-backend: the engine-agnostic core of an NVFP4 KV cache (format, layouts, reference, ops)."""
from . import format
from .layout import PagedKVCache
from .ops import AttentionPlan, paged_attention, plan_attention, write_kv

__all__ = ["format", "PagedKVCache", "AttentionPlan", "paged_attention", "plan_attention", "write_kv"]
__version__ = "0.1.0"
