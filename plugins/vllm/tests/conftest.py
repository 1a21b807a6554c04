"""Fixtures: a real VllmConfig for a tiny local model (a config.json only; no weights, no network)."""
from __future__ import annotations

import itertools
import json
import logging
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory; never reach a hub

# Llama-shaped, GQA group 4, head_dim 128: the shape class of Llama-3-8B at a fraction of the size.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16", "rope_theta": 10000.0,
}
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def registered():
    import nvfp4_vllm
    nvfp4_vllm.register()


@pytest.fixture
def make_config(tiny_model):
    """``EngineArgs(...).create_engine_config()``: the engine's own config path, no model load."""
    from vllm.engine.arg_utils import EngineArgs

    def make(**overrides):
        kwargs = dict(model=tiny_model, skip_tokenizer_init=True, kv_cache_dtype="nvfp4",
                      attention_backend="CUSTOM", max_model_len=MAX_MODEL_LEN, block_size=16)
        kwargs.update(overrides)
        return EngineArgs(**kwargs).create_engine_config()

    return make


def cuda_or_skip(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


_layer_ids = itertools.count()


def make_layer(config, num_heads: int = 8, num_kv_heads: int = 2, head_size: int = 128,
               selected_by_vllm: bool = False, **kwargs):
    """A real vLLM ``Attention`` layer on this backend: it builds the impl with vLLM's own
    arguments, holds the ``_k_scale``/``_v_scale`` tensors and registers in the forward context.
    ``selected_by_vllm``: the backend vLLM's selector and current platform pick for ``config``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from nvfp4_vllm.backend import Nvfp4XqaBackend

    with set_current_vllm_config(config):
        return Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads=num_kv_heads,
                         cache_config=config.cache_config, prefix=f"model.layers.{next(_layer_ids)}.attn",
                         attn_backend=None if selected_by_vllm else Nvfp4XqaBackend, **kwargs)


@pytest.fixture
def vllm_log(caplog):
    """caplog on vLLM's "vllm" logger, which does not propagate to the root logger caplog watches."""
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        vllm_logger.removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def no_dense_prefill_yet(monkeypatch):
    """Each test starts from a process that has made no dense prefill (nvfp4_vllm.dense keeps one)."""
    monkeypatch.setattr("nvfp4_vllm.dense._made", {})


@pytest.fixture(autouse=True)
def dense_prefill_at_any_size(monkeypatch):
    """Test steps are small: the dense path is planned for them whatever their work
    (``DensePrefill.min_flops``; its own test sets it back)."""
    from nvfp4_backend.dense_prefill import DensePrefill
    monkeypatch.setattr(DensePrefill, "min_flops", 0)
