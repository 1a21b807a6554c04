"""nvfp4-backend: the engine-agnostic core of an NVFP4 KV cache.

Layers, each a module: ``format`` (the bytes), ``layout`` (a paged cache's views), ``modes`` (KV
modes), ``reference`` (the PyTorch oracle), ``ops`` (the custom ops), ``planner`` (split-KV and
heads-per-block plans), ``extend`` (long extends), ``capabilities`` (what the kernels serve: the one
module the engine plugins ask), ``jit`` and ``build`` (building the kernels).  ``tools`` and
``eval`` are applications on top.
"""
from . import format
from .layout import PagedKVCache
from .modes import KVMode
from .ops import paged_attention, write_kv
from .planner import AttentionPlan, plan_attention

__all__ = ["format", "PagedKVCache", "KVMode", "AttentionPlan", "paged_attention", "plan_attention", "write_kv"]
__version__ = "0.1.0"
