"""The CPU path: the opt-in platform plugin, the CPU_ATTN guard on the stock platform, the mode log line.

These run in the pytest process, on vLLM's stock CPU platform; where a test needs this plugin's
platform, it installs an ``Nvfp4CpuPlatform`` as ``vllm.platforms.current_platform``.
test_engine.py runs both platforms for real, in engine processes.
"""
from __future__ import annotations

import importlib.metadata

import pytest
import torch
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

import nvfp4_vllm
from conftest import make_layer
from nvfp4_backend.modes import KV_MODE_ENV
from nvfp4_vllm import BACKEND_CLASS_PATH, CPU_PLATFORM_CLASS_PATH, CPU_PLATFORM_ENV
from nvfp4_vllm.backend import Nvfp4XqaBackend, Nvfp4XqaImpl
from nvfp4_vllm.cpu_guard import CpuAttentionImplRefusingNvfp4
from nvfp4_vllm.cpu_platform import Nvfp4CpuPlatform, cpu_path_active

SELECTION = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="nvfp4", block_size=None)


@pytest.fixture
def nvfp4_cpu_platform(monkeypatch):
    """This plugin's platform as the current one, as an engine process with the opt-in has it."""
    monkeypatch.setattr(vllm.platforms, "current_platform", Nvfp4CpuPlatform())
    assert cpu_path_active()


def test_platform_entry_point_declared():
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.platform_plugins") if ep.name == "nvfp4_cpu"]
    assert [ep.value for ep in eps] == ["nvfp4_vllm:platform_plugin"]


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("0", None), ("1", CPU_PLATFORM_CLASS_PATH)])
def test_platform_plugin_is_opt_in(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(CPU_PLATFORM_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_PLATFORM_ENV, value)
    assert nvfp4_vllm.platform_plugin() == expected


@pytest.mark.parametrize("stock", [None, "vllm.platforms.zen_cpu.ZenCpuPlatform"])
def test_platform_plugin_leaves_other_platforms_alone(monkeypatch, stock):
    # Not a CPU build of vLLM (None), or a CPU platform other than the stock CpuPlatform.
    monkeypatch.setenv(CPU_PLATFORM_ENV, "1")
    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin", lambda: stock)
    assert nvfp4_vllm.platform_plugin() is None


def test_stock_platform_is_not_the_cpu_path():
    assert type(vllm.platforms.current_platform) is CpuPlatform
    assert not cpu_path_active()
    assert not Nvfp4XqaBackend.supports_compute_capability(None)
    reasons = Nvfp4XqaBackend.validate_configuration(**SELECTION._asdict(), device_capability=None)
    assert reasons == [f"no CUDA device; on vLLM's CPU platform set {CPU_PLATFORM_ENV}=1 (nvfp4_vllm's CPU platform)"]


@pytest.mark.parametrize("selected", ["CUSTOM", "NVFP4_XQA"])
def test_platform_honours_selected_backend(nvfp4_cpu_platform, selected):
    assert Nvfp4XqaBackend.supports_compute_capability(None)
    path = Nvfp4CpuPlatform.get_attn_backend_cls(AttentionBackendEnum[selected], SELECTION)
    assert path == BACKEND_CLASS_PATH


@pytest.mark.parametrize("selected", [None, "CPU_ATTN"])
def test_platform_changes_nothing_else(nvfp4_cpu_platform, selected):
    backend = None if selected is None else AttentionBackendEnum[selected]
    assert Nvfp4CpuPlatform.get_attn_backend_cls(backend, SELECTION) == \
        CpuPlatform.get_attn_backend_cls(backend, SELECTION)


@pytest.mark.parametrize("change, reason", [
    (dict(dtype=torch.float32), "dtype torch.float32 is not float16 or bfloat16"),
    (dict(head_size=96), "head_size 96 is not one of [64, 128, 256]"),
    (dict(block_size=8), "block_size 8 is not a multiple of one of [16, 32, 64, 128]"),
])
def test_platform_refuses_what_the_kernels_cannot_take(nvfp4_cpu_platform, change, reason):
    # vLLM asks the platform while it builds each attention layer: startup, before any request.
    with pytest.raises(ValueError, match="Selected backend CUSTOM") as err:
        Nvfp4CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, SELECTION._replace(**change))
    assert reason in str(err.value)


def test_stock_platform_refuses_nvfp4_cache(make_config):
    # vLLM's own selector on the stock platform: CPU_ATTN (our guard) for every selection.
    config = make_config(kv_cache_dtype="nvfp4", attention_backend="CUSTOM")
    with pytest.raises(ValueError, match="CPU_ATTN.*cannot read the 'nvfp4' KV cache") as err:
        make_layer(config, selected_by_vllm=True)
    assert f"set {CPU_PLATFORM_ENV}=1" in str(err.value) and "--attention-backend CUSTOM" in str(err.value)


def test_opt_in_platform_refuses_nvfp4_cache_without_the_backend(nvfp4_cpu_platform, make_config):
    # The opt-in changes nothing else: without --attention-backend, CPU_ATTN is chosen, and refuses.
    config = make_config(kv_cache_dtype="nvfp4", attention_backend=None)
    with pytest.raises(ValueError, match="select the NVFP4 backend: --attention-backend CUSTOM"):
        make_layer(config, selected_by_vllm=True)


def test_stock_platform_serves_other_caches_unchanged(make_config):
    layer = make_layer(make_config(kv_cache_dtype="auto", attention_backend=None), selected_by_vllm=True)
    assert type(layer.impl) is CpuAttentionImplRefusingNvfp4  # CPU_ATTN's impl, nothing overridden


def test_kv_mode_line_reaches_vllm_log(monkeypatch, vllm_log):
    from vllm.logger import _print_info_once
    _print_info_once.cache_clear()  # an earlier test may have logged the same line once already
    monkeypatch.setenv(KV_MODE_ENV, "hadamard")
    Nvfp4XqaImpl(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2, kv_cache_dtype="nvfp4_4over6")
    lines = [r for r in vllm_log.records if "NVFP4 KV mode" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "vllm.nvfp4_vllm.backend"
    assert "'hadamard-6or4'" in lines[0].getMessage()
