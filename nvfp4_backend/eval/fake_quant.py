"""The fake-quantizing cross-check of the evaluation: the model's own unpaged forward with K and V
rounded to a KV format right after RoPE, then SDPA.  Never used to produce the eval's own numbers;
it is the independent computation the paged path is compared with."""
from __future__ import annotations

import torch

from .. import format as fmt
from .kv_stores import FP8_MAX, get_format
from .models import model_geometry

FAKE_QUANT_IMPLEMENTATION = "nvfp4_backend_fake_quant"
_FQ_STATE: dict = {}


def fake_quant(x: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """x rounded to a KV format and back: "nvfp4" (format.quantize + dequantize), "fp8" (a satfinite
    E4M3 cast), anything else x in fp32."""
    if kind == "nvfp4":
        return fmt.dequantize(*fmt.quantize(x, scale), scale)
    if kind == "fp8":
        x = x.float() * (1.0 / scale)
        return torch.where(torch.isnan(x), x, x.clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn).float() * scale
    return x.float()


def fake_quant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """K and V rounded to the format after RoPE, then plain causal SDPA (fp32), q/out in attn_dtype."""
    st = _FQ_STATE
    dt, kind = st["attn_dtype"], st["kind"]
    ks, vs = st["scales"][module.layer_idx]
    q = query.to(dt).float()
    k = fake_quant(key.to(dt), kind, ks)
    v = fake_quant(value.to(dt), kind, vs)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scaling,
                                                         enable_gqa=True)
    return o.to(dt).transpose(1, 2).to(query.dtype), None


@torch.inference_mode()
def fake_quant_logits(model, tokens: list[int], kv_format: str, kv_scales=None,
                      attn_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Logits [len(tokens), vocab] of the model's own forward with fake-quantized K/V (cross-check only).

    The independent computation the real path is compared with: the model's usual unpaged
    forward, K and V rounded to the format right after RoPE (``format.quantize`` +
    ``format.dequantize`` for NVFP4; a satfinite E4M3 cast for FP8), then SDPA.  Never used to
    produce the eval's own numbers.
    """
    from transformers import AttentionInterface

    f = get_format(kv_format)
    layers = model_geometry(model)[0]
    kind = "nvfp4" if f.kind == "nvfp4" else ("fp8" if f.storage == torch.float8_e4m3fn else "plain")
    if kind == "plain" and f.storage == torch.float32:
        attn_dtype = torch.float32
    AttentionInterface.register(FAKE_QUANT_IMPLEMENTATION, fake_quant_attention)
    _FQ_STATE.update(kind=kind, attn_dtype=attn_dtype, scales=kv_scales or [(1.0, 1.0)] * layers)
    previous = model.config._attn_implementation
    model.set_attn_implementation(FAKE_QUANT_IMPLEMENTATION)
    try:
        dev = next(model.parameters()).device
        return model(input_ids=torch.tensor(tokens, device=dev)[None], use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)
