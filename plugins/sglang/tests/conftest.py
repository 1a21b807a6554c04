"""Shared fixtures: the plugin loaded through SGLang's own loader, and a small serving harness.

The harness is SGLang's real NVFP4 ``MHATokenToKVPool``, ``ReqToTokenPool``, ``RadixAttention``
layers and ``ForwardBatch`` objects; only the ModelRunner is a namespace carrying the five things
the backend reads (a real one needs a GPU and a model).  Expected outputs come from a dense fp64
attention over the K/V as the NVFP4 format stores them (``nvfp4_backend.format``).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nvfp4_backend import format as fmt


def pytest_configure(config):
    # SGLang's AWQ/GGUF modules warn at import on a machine without CUDA; nothing to act on.
    config.addinivalue_line("filterwarnings", "ignore:Only CUDA")


@pytest.fixture(scope="session", autouse=True)
def plugins_loaded():
    from sglang.srt.plugins import load_plugins
    load_plugins()


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A local HF config (no weights): enough for SGLang's ModelConfig in argument resolution."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
           "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def rotated(x, mode):
    """What the pool holds for x before quantization: x, or x H in x's dtype (as the core rotates)."""
    if mode.rotation == "none":
        return x
    return fmt.hadamard_transform(x).to(x.dtype)


def stored_values(x, g, mode):
    """fp64 values attention sees for x: quantized with the mode, dequantized, rotated back."""
    y = fmt.dequantize(*fmt.quantize(rotated(x, mode), g, mode.scale_rule), g, torch.float64)
    return y if mode.rotation == "none" else y @ fmt.hadamard(x.shape[-1], dtype=torch.float64)


class Harness:
    """Requests that grow by extend/decode steps over a real pool, checked against dense fp64."""

    def __init__(self, device="cpu", *, q_heads=8, kv_heads=2, head_dim=64, page_size=4, num_pages=48,
                 max_reqs=4, max_context=96, layers=None, scales=((0.004, 0.002), (0.01, 0.003)),
                 backends=("nvfp4-xqa", "nvfp4-xqa"), native_scale_layout=False):
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import KV_CACHE_QUANT_REGISTRY
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.device, self.page_size = torch.device(device), page_size
        self.gen = torch.Generator().manual_seed(0)
        layers = layers or [{} for _ in scales]
        # The recipe as SGLang's configurator builds it; native_scale_layout is what SGLang derives
        # from the GPU (True on SM100), pinned here.
        recipe = KV_CACHE_QUANT_REGISTRY["nvfp4"](num_layers=len(layers), device=device, page_size=page_size,
                                                  native_scale_layout=native_scale_layout)
        recipe.configure_attention_backends(*backends)
        for i, (kg, vg) in enumerate(scales):  # what load_scales_from_model leaves per layer
            recipe.k_scales_gpu[i], recipe.v_scales_gpu[i] = kg, vg
            recipe.k_scales_float[i], recipe.v_scales_float[i] = kg, vg
        self.scales = scales
        self.pool = MHATokenToKVPool(size=num_pages * page_size, page_size=page_size,
                                     dtype=torch.float4_e2m1fn_x2, head_num=kv_heads, head_dim=head_dim,
                                     layer_num=len(layers), device=device, enable_memory_saver=False,
                                     quant_method=recipe)
        self.req_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=device,
                                       enable_memory_saver=False)
        self.runner = SimpleNamespace(
            device=device, token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool,
            model_config=SimpleNamespace(context_len=max_context, num_attention_heads=q_heads,
                                         num_key_value_heads=kv_heads))
        self.backend = ATTENTION_BACKENDS["nvfp4-xqa"](self.runner)
        self.layers = [RadixAttention(q_heads, head_dim, head_dim ** -0.5, kv_heads, layer_id=i, **kw)
                       for i, kw in enumerate(layers)]
        # Pages in random order; page 0 (slots [0, page_size)) is SGLang's padding page.
        self.free_pages = (torch.randperm(num_pages, generator=self.gen) + 1).tolist()
        self.pages: dict[int, list[int]] = {}
        self.kv: dict[tuple[int, int], tuple[list, list]] = {}  # (req, layer) -> stored K, V rows

    # ---------------------------------------------------------------- batch building
    def _slots(self, req: int, start: int, n: int) -> list[int]:
        pages = self.pages.setdefault(req, [])
        slots = []
        for pos in range(start, start + n):
            if pos % self.page_size == 0:
                pages.append(self.free_pages.pop())
            slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        self.req_pool.req_to_token[req, start:start + n] = torch.tensor(slots, dtype=torch.int32)
        return slots

    def length(self, req: int) -> int:
        return len(self.kv.get((req, 0), ([], []))[0])

    def batch(self, new_tokens: dict[int, int], decode: bool = False, pad_to: int | None = None):
        """A real ForwardBatch adding ``new_tokens[req]`` tokens to each request."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        reqs = list(new_tokens)
        prefix = [self.length(r) for r in reqs]
        n = [new_tokens[r] for r in reqs]
        loc = [s for r, p, k in zip(reqs, prefix, n) for s in self._slots(r, p, k)]
        seq = [p + k for p, k in zip(prefix, n)]
        if pad_to is not None:  # CUDA-graph padding: request row 0, length 1, the padding slot
            extra = pad_to - len(reqs)
            reqs, seq, loc, n = reqs + [0] * extra, seq + [1] * extra, loc + [0] * extra, n + [1] * extra
        t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
                          batch_size=len(reqs), input_ids=t([0] * sum(n)), req_pool_indices=t(reqs),
                          seq_lens=t(seq), out_cache_loc=t(loc), seq_lens_sum=sum(seq),
                          seq_lens_cpu=torch.tensor(seq))
        if not decode:
            fb.extend_seq_lens, fb.extend_seq_lens_cpu = t(n, torch.int32), n
            fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = t(prefix, torch.int32), prefix
            fb.extend_num_tokens = sum(n)
        fb.nvfp4_test_new = dict(zip(list(new_tokens), n))
        return fb

    def qkv(self, fb, layer):
        """Random bf16 q, k, v for the batch's tokens (k, v as RadixAttention hands them)."""
        tokens = fb.input_ids.shape[0]
        shape = lambda h: (tokens, h, layer.head_dim)  # noqa: E731
        q, k, v = (torch.randn(shape(h), generator=self.gen).to(torch.bfloat16).to(self.device)
                   for h in (layer.tp_q_head_num, layer.tp_k_head_num, layer.tp_k_head_num))
        return q.view(tokens, -1), k, v

    # ---------------------------------------------------------------- reference
    def record(self, fb, layer, k, v):
        """Keep the K/V each real request stores, as NVFP4 holds them (quantize -> dequantize)."""
        kg, vg = self.scales[layer.layer_id]
        mode = self.backend.kv_mode
        row = 0
        for req, n in fb.nvfp4_test_new.items():
            ks, vs = self.kv.setdefault((req, layer.layer_id), ([], []))
            for x, g, dst in ((k, kg, ks), (v, vg, vs)):
                dst.extend(stored_values(x[row:row + n].cpu(), g, mode))
            row += n

    def expected(self, fb, layer, q, sinks=None):
        """Dense fp64 causal attention of the batch's real query rows over the recorded K/V."""
        q = q.view(q.shape[0], layer.tp_q_head_num, layer.head_dim).cpu().double()
        group = layer.tp_q_head_num // layer.tp_k_head_num
        window = layer.sliding_window_size + 1 if layer.sliding_window_size >= 0 else None
        out, row = [], 0
        for req, n in fb.nvfp4_test_new.items():
            ks, vs = self.kv[(req, layer.layer_id)]
            K, V = torch.stack(ks), torch.stack(vs)  # [len, kv_heads, D]
            K, V = K.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
            total = K.shape[0]
            for i in range(n):
                pos = total - n + i
                lo = 0 if window is None else max(0, pos - window + 1)
                s = torch.einsum("hd,lhd->hl", q[row + i], K[lo:pos + 1]) * layer.scaling
                if layer.logit_cap:
                    s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
                if sinks is not None:  # one extra logit per head that takes probability, no value
                    s = torch.cat([s, sinks.double().cpu()[:, None]], -1)
                out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1)[:, :pos + 1 - lo], V[lo:pos + 1]))
            row += n
        return torch.stack(out).flatten(1)

    def run_step(self, fb, *, graph_metadata=False, sinks=None):
        """Write + attend every layer through the backend; returns [(got, want)] per layer."""
        if not graph_metadata:
            self.backend.init_forward_metadata(fb)
        results = []
        real = sum(fb.nvfp4_test_new.values())
        for layer in self.layers:
            q, k, v = self.qkv(fb, layer)
            extra = {} if sinks is None else {"sinks": sinks}
            got = self.backend.forward(q, k, v, layer, fb, **extra)
            self.record(fb, layer, k, v)
            results.append((got[:real].float().cpu(), self.expected(fb, layer, q[:real], sinks).float()))
        return results


@pytest.fixture
def harness():
    return Harness


def assert_close(results, atol=1.5e-2, rtol=1.5e-2):
    for layer, (got, want) in enumerate(results):
        assert got.shape == want.shape, f"layer {layer}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"layer {layer}: non-finite output"
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"layer {layer}: {m}")


@pytest.fixture(autouse=True)
def dense_prefill_at_any_size(monkeypatch):
    """Test steps are small: the dense path is planned for them whatever their work
    (``DensePrefill.min_flops``; its own test sets it back)."""
    from nvfp4_backend.dense_prefill import DensePrefill
    monkeypatch.setattr(DensePrefill, "min_flops", 0)
