"""Discovery through SGLang's loader, the CLI choice, the registry and the KV access entry."""
import importlib.metadata

import pytest
import torch

import nvfp4_sglang
from nvfp4_sglang import registration

NAME = nvfp4_sglang.BACKEND_NAME


def test_entry_point_is_discovered_by_sglang():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("nvfp4_xqa") == "nvfp4_sglang:register"
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert plugins["nvfp4_xqa"][0] is nvfp4_sglang.register


def test_load_plugins_registered_choice_and_factory():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    assert ATTENTION_BACKEND_CHOICES.count(NAME) == 1
    assert ATTENTION_BACKENDS[NAME] is registration.create_backend


def test_register_is_idempotent():
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import KV_CACHE_ATTENTION_ACCESS_REGISTRY
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    for _ in range(3):
        nvfp4_sglang.register()
    assert ATTENTION_BACKEND_CHOICES.count(NAME) == 1
    ours = [a for a in KV_CACHE_ATTENTION_ACCESS_REGISTRY["nvfp4"] if NAME in a.backend_matcher.exact]
    assert sorted(a.phase.value for a in ours) == ["decode", "prefill"]


def test_failed_registration_stops_the_process(monkeypatch):
    """SGLang's loader swallows Exception; SystemExit gets through with the reason."""
    def broken():
        raise RuntimeError("no registry here")
    monkeypatch.setattr(registration, "register_all", broken)
    with pytest.raises(SystemExit, match="nvfp4-xqa.*RuntimeError: no registry here"):
        nvfp4_sglang.register()


def test_name_taken_by_another_factory_is_refused(monkeypatch):
    from sglang.srt.layers.attention import attention_registry
    monkeypatch.setitem(attention_registry.ATTENTION_BACKENDS, NAME, lambda runner: None)
    with pytest.raises(SystemExit, match="already registered"):
        nvfp4_sglang.register()


def test_access_entry_resolves_for_both_phases():
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        KV_CACHE_QUANT_REGISTRY, KVCacheAttentionAccessKind)
    recipe = KV_CACHE_QUANT_REGISTRY["nvfp4"](num_layers=1, device="cpu", native_scale_layout=False)
    for phase in ("prefill", "decode"):
        access = recipe.resolve_attention_access(phase, NAME)
        assert access is not None and access.kind == KVCacheAttentionAccessKind.NATIVE_FP4
        assert access.storage_dtype == torch.uint8 and access.scale_recipe == "nvfp4"
    assert not recipe.needs_plain_kv_dequant_read()  # a PLAIN entry would break pool reads


@pytest.mark.parametrize("native", [False, True], ids=["sm90_sm120", "sm100"])
@pytest.mark.parametrize("backends,linear,native_sf,workspace", [
    (("nvfp4-xqa", "nvfp4-xqa"), True, False, False),
    (("flashinfer", "nvfp4-xqa"), True, False, True),
    (("flashinfer", "trtllm_mha"), True, None, True),   # SGLang's own recipe, unchanged
    (("trtllm_mha", "trtllm_mha"), None, None, False),
])
def test_recipe_scale_buffers(native, backends, linear, native_sf, workspace):
    """The recipe allocates token-linear scales whenever nvfp4-xqa is selected, and otherwise
    exactly what SGLang's own NVFP4KVCacheMethod would (None = the parent's answer)."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import KV_CACHE_QUANT_REGISTRY, NVFP4KVCacheMethod
    ours = KV_CACHE_QUANT_REGISTRY["nvfp4"](num_layers=1, device="cpu", native_scale_layout=native)
    theirs = NVFP4KVCacheMethod(num_layers=1, device="cpu", native_scale_layout=native)
    assert isinstance(ours, NVFP4KVCacheMethod)
    for recipe in (ours, theirs):
        recipe.configure_attention_backends(*backends)
    if NAME not in backends:
        linear, native_sf = theirs.needs_linear_scale_buffer(), theirs.needs_native_fp4_scales()
    assert ours.needs_linear_scale_buffer() is linear
    assert ours.needs_native_fp4_scales() is native_sf
    assert ours.needs_dequant_workspace() is workspace
