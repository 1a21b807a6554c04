"""Run a Hugging Face decoder (Llama architecture) with its attention over this project's paged KV cache.

How it hooks in
---------------
transformers (>= 4.53, tested with 5.24) calls attention through ``AttentionInterface``: each
attention module projects q/k/v, applies RoPE, then calls the function registered under
``config._attn_implementation``.  This module registers one such function, ``"nvfp4_backend_paged"``
(``paged_attention_forward``).  ``PagedRunner`` switches the model to it for the duration of each of
its forward calls (and back afterwards), runs the model with ``use_cache=False`` on a *packed*
batch (all requests' new tokens in one row, ``position_ids`` per token, as a serving engine packs
them) and hands the step's paging metadata to the function through the forward's kwargs.  Per layer
the function then does what an engine's attention backend does:

1. **quantize-on-write**: the new tokens' post-RoPE K and V go into their cache slots
   (``nvfp4``: ``ops.write_kv``; ``bf16``/``fp8``/``fp32``: a paged tensor of that dtype);
2. **paged attention** of the new queries over everything the request has in the cache, read back
   from the pages (``nvfp4``: ``ops.paged_attention``: the PyTorch reference on CPU, the CUDA
   kernels on a GPU where they serve the shape; the other formats: gather + dequantize + the
   core's ``reference.attention_ref``, so every format shares one attention arithmetic).

Prefill writes the prompt and attends over the cache (the prompt's own K/V are read back from the
cache in the cache's format, exactly like later decode steps read them); decode then feeds one
token per request per step.  Attention inputs and outputs are ``attn_dtype`` (BF16 by default,
as in a BF16 serving engine: the NVFP4 ops take fp16/bf16 queries); its math is fp32.  The
``fp32`` format keeps everything fp32 and reproduces the model's own forward: it is the test oracle.

Pages are handed out from a fixed shuffled free list, so a request's pages are not contiguous and
the block table is really exercised.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .kv_stores import DenseStore, NVFP4Store, StepMeta, get_format
from .models import model_geometry

ATTN_IMPLEMENTATION = "nvfp4_backend_paged"


@dataclass
class _Context:
    store: DenseStore | NVFP4Store
    meta: StepMeta
    attn_dtype: torch.dtype


# ============================================================================ the attention function
def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: quantize-on-write the new K/V, then paged attention over the cache.

    query [1, Hq, T, D], key/value [1, Hkv, T, D] (post-RoPE, T packed tokens of all requests).
    Returns ([1, T, Hq, D], None) as every transformers attention function does.
    """
    ctx: _Context | None = kwargs.get("paged_kv")
    if ctx is None:
        raise RuntimeError(f"attn_implementation {ATTN_IMPLEMENTATION!r} needs a PagedRunner step (paged_kv kwarg)")
    if query.shape[0] != 1:
        raise ValueError(f"the paged runner packs requests into one row, got a query batch of {query.shape[0]}")
    layer = module.layer_idx
    dt = ctx.attn_dtype
    q = query[0].transpose(0, 1).to(dt)
    k = key[0].transpose(0, 1).to(dt)
    v = value[0].transpose(0, 1).to(dt)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    ctx.store.write(layer, k, v, ctx.meta.slot_mapping)
    sinks = kwargs.get("s_aux")
    out = ctx.store.attend(layer, q, ctx.meta, float(scaling), sliding_window=kwargs.get("sliding_window"),
                           soft_cap=kwargs.get("softcap"), sinks=None if sinks is None else sinks.float())
    return out.unsqueeze(0).to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


# ============================================================================ the runner
class PagedRunner:
    """A tiny serving engine around a transformers model: paged KV cache, packed prefill, batched decode.

    ``kv_scales``: per-layer (k_scale, v_scale) dequant multipliers; required by the ``*-amax``
    formats (see ``calibrate_kv_amax`` and ``kv_scales_from_amax``), 1.0 otherwise.
    """

    def __init__(self, model, kv_format: str = "nvfp4", *, kv_scales: list[tuple[float, float]] | None = None,
                 page_size: int = 16, max_tokens: int = 4096, attn_dtype: torch.dtype = torch.bfloat16,
                 layout: str = "NHD", record_amax: bool = False, seed: int = 0):
        _register()
        self.model = model
        self.format = get_format(kv_format)
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.num_layers, self.num_kv_heads, self.head_dim = model_geometry(model)
        if kv_scales is None:
            if self.format.scale == "amax":
                raise ValueError(f"kv_scales is required for kv_format {kv_format!r} (calibrate_kv_amax + kv_scales_from_amax)")
            kv_scales = [(1.0, 1.0)] * self.num_layers
        if len(kv_scales) != self.num_layers:
            raise ValueError(f"kv_scales has {len(kv_scales)} entries for {self.num_layers} layers")
        for i, (ks, vs) in enumerate(kv_scales):
            if not (ks > 0 and vs > 0 and math.isfinite(ks) and math.isfinite(vs)):
                raise ValueError(f"kv_scales[{i}] must be positive and finite, got {(ks, vs)}")
        self.kv_scales = [(float(k), float(v)) for k, v in kv_scales]
        self.attn_dtype = torch.float32 if self.format.name == "fp32" else attn_dtype
        if self.attn_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"attn_dtype must be float16 or bfloat16, got {attn_dtype}")
        if self.format.kind == "nvfp4" and self.attn_dtype == torch.float32:
            raise ValueError("attn_dtype must be float16 or bfloat16 for the nvfp4 formats (the ops take fp16/bf16 queries)")
        self.device = next(model.parameters()).device
        self.page_size = page_size
        self.num_pages = -(-max_tokens // page_size) + 8
        if self.format.kind == "nvfp4":
            self.store = NVFP4Store(self.num_layers, self.num_pages, page_size, self.num_kv_heads, self.head_dim,
                                    self.kv_scales, self.device, layout, self.format.mode)
        else:
            self.store = DenseStore(self.format, self.num_layers, self.num_pages, page_size, self.num_kv_heads,
                                    self.head_dim, self.kv_scales, self.device, record_amax)
        g = torch.Generator().manual_seed(seed)
        self._free = torch.randperm(self.num_pages, generator=g).tolist()
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ bookkeeping
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.format.bytes_per_token_head(self.head_dim)

    def add_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._pages[sid], self._lens[sid] = [], 0
        return sid

    def free(self, sid: int) -> None:
        self._free.extend(reversed(self._pages.pop(sid)))
        self._lens.pop(sid)

    def seq_len(self, sid: int) -> int:
        return self._lens[sid]

    def _reserve(self, sid: int, new_len: int) -> None:
        pages = self._pages[sid]
        need = -(-new_len // self.page_size) - len(pages)
        if need > len(self._free):
            raise RuntimeError(f"KV cache full: {self.num_pages} pages of {self.page_size}; raise max_tokens")
        for _ in range(need):
            pages.append(self._free.pop())

    @contextmanager
    def _attention_switched(self):
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, seq_ids: list[int], tokens: list[list[int]], all_logits: bool = False) -> list[torch.Tensor]:
        """Append ``tokens[i]`` to request ``seq_ids[i]`` (prefill, extend or decode; one packed forward).

        Returns per request its logits: [len(tokens[i]), vocab] with ``all_logits``, else [vocab]
        of its last new token.  fp32.
        """
        if len(seq_ids) != len(tokens) or not seq_ids:
            raise ValueError(f"seq_ids and tokens must be non-empty and of equal length, got {len(seq_ids)} and {len(tokens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        flat, pos, slots, qsl = [], [], [], [0]
        for sid, toks in zip(seq_ids, tokens):
            if sid not in self._lens:
                raise ValueError(f"unknown sequence id {sid}")
            if not toks:
                raise ValueError(f"tokens for sequence {sid} are empty")
            start = self._lens[sid]
            self._reserve(sid, start + len(toks))
            pages = self._pages[sid]
            for p in range(start, start + len(toks)):
                slots.append(pages[p // self.page_size] * self.page_size + p % self.page_size)
            flat.extend(toks)
            pos.extend(range(start, start + len(toks)))
            qsl.append(qsl[-1] + len(toks))
        for sid, toks in zip(seq_ids, tokens):
            self._lens[sid] += len(toks)
        max_pages = max(len(self._pages[s]) for s in seq_ids)
        bt = torch.zeros(len(seq_ids), max_pages, dtype=torch.int32)
        for i, sid in enumerate(seq_ids):
            bt[i, :len(self._pages[sid])] = torch.tensor(self._pages[sid], dtype=torch.int32)
        dev = self.device
        meta = StepMeta(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=bt.to(dev),
            seq_lens=torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(len(t) for t in tokens), page_size=self.page_size)
        ids = torch.tensor(flat, dtype=torch.long, device=dev)[None]
        position_ids = torch.tensor(pos, dtype=torch.long, device=dev)[None]
        keep = 0 if all_logits else torch.tensor([e - 1 for e in qsl[1:]], dtype=torch.long, device=dev)
        with self._attention_switched():
            out = self.model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
                             paged_kv=_Context(self.store, meta, self.attn_dtype))
        logits = out.logits[0].float()
        if all_logits:
            return [logits[a:b] for a, b in zip(qsl[:-1], qsl[1:])]
        return list(logits.unbind(0))

    # ------------------------------------------------------------------ whole requests
    def score(self, tokens: list[int], prefill_len: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        """Logits [len(tokens), vocab] of one request: prefill (in chunks) then token-by-token decode.

        The first ``prefill_len`` tokens (default: all) are prefilled in chunks of ``chunk_size``
        (default: one chunk); the rest are decoded one per step, teacher-forced.
        """
        n = len(tokens)
        prefill_len = n if prefill_len is None else prefill_len
        if not 1 <= prefill_len <= n:
            raise ValueError(f"prefill_len must be in [1, {n}], got {prefill_len}")
        chunk_size = chunk_size or prefill_len
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        sid = self.add_sequence()
        try:
            parts = []
            for a in range(0, prefill_len, chunk_size):
                parts += self.step([sid], [tokens[a:min(a + chunk_size, prefill_len)]], all_logits=True)
            for t in tokens[prefill_len:]:
                parts.append(self.step([sid], [[t]])[0][None])
            return torch.cat(parts)
        finally:
            self.free(sid)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_ids=(), progress=None) -> list[list[int]]:
        """Greedy generation: batched prefill of all prompts, then batched decode steps.

        A request stops at an EOS token (kept in its output) or after ``max_new_tokens``.
        """
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        eos = set(eos_token_ids or ())
        sids = [self.add_sequence() for _ in prompts]
        outs: list[list[int]] = [[] for _ in prompts]
        try:
            logits = self.step(sids, [list(p) for p in prompts])
            active = list(range(len(prompts)))
            for i in range(max_new_tokens):
                nxt = {}
                for j, lg in zip(active, logits):
                    t = int(lg.argmax())
                    outs[j].append(t)
                    nxt[j] = t
                active = [j for j in active if nxt[j] not in eos]
                if progress is not None:
                    progress()
                if not active or i == max_new_tokens - 1:
                    break
                logits = self.step([sids[j] for j in active], [[nxt[j]] for j in active])
            return outs
        finally:
            for s in sids:
                self.free(s)


# ============================================================================ calibration
def calibrate_kv_amax(model, token_windows: list[list[int]], **runner_kwargs) -> list[tuple[float, float]]:
    """Per-layer max |K| and max |V| (post-RoPE, BF16 as the engine holds them) over the given texts."""
    runner = PagedRunner(model, "bf16", record_amax=True,
                         max_tokens=max(len(w) for w in token_windows), **runner_kwargs)
    for w in token_windows:
        runner.score(w)
    return [(k, v) for k, v in runner.store.amax]


def kernel_path(device) -> str:
    """Which implementation serves ``ops.paged_attention`` on this device (for reports)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "PyTorch reference (CPU)"
    from .. import capabilities, jit
    if capabilities.kernels_available(device):
        return (f"CUDA kernels ({jit.module_name(torch.cuda.get_device_capability(device))}) for decode "
                f"(q_len x group <= {capabilities.decode_max_rows(128)}, {capabilities.decode_max_rows(256)} at head dim 256); "
                f"longer prefills dequantized once and run through torch SDPA (window, soft-cap or sinks: "
                f"the PyTorch reference)")
    return f"PyTorch reference on the GPU (kernels unavailable: {capabilities.unavailable_reason(torch.cuda.get_device_capability(device))})"
