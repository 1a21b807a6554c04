"""What the backend declares: configuration checks, page sizing, layouts, CUDA-graph support."""
from __future__ import annotations

import pytest
import torch
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, KVQuantMode
from vllm.v1.worker.utils import customize_attention_spec

from nvfp4_backend import format as fmt
from conftest import make_layer as _layer
from nvfp4_vllm.backend import BLOCK_SIZES, HEAD_SIZES, Nvfp4XqaBackend as Backend

SUPPORTED = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="nvfp4", block_size=16, use_mla=False,
                 has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                 device_capability=DeviceCapability(9, 0), attn_type="decoder")


def validate(**changes) -> list[str]:
    return Backend.validate_configuration(**{**SUPPORTED, **changes})


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_accepts_supported(head_size, dtype, block_size):
    assert validate(head_size=head_size, dtype=dtype, block_size=block_size) == []


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_accepts_compute_capabilities(cap):
    assert validate(device_capability=DeviceCapability(*cap)) == []


@pytest.mark.parametrize("kv_cache_dtype", ["nvfp4", "nvfp4_4over6"])
def test_accepts_both_nvfp4_cache_dtypes(kv_cache_dtype):
    assert validate(kv_cache_dtype=kv_cache_dtype) == []


def test_accepts_features_the_kernels_have():
    assert validate(has_sink=True, has_sliding_window=True) == []


@pytest.mark.parametrize("change, reason", [
    (dict(head_size=96), "head_size 96 is not one of [64, 128, 256]"),
    (dict(head_size=512), "head_size 512"),
    (dict(dtype=torch.float32), "dtype torch.float32 is not float16 or bfloat16"),
    (dict(kv_cache_dtype="auto"), "kv_cache_dtype 'auto' is not one of ['nvfp4', 'nvfp4_4over6']"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8'"),
    (dict(block_size=8), "block_size 8 is not a multiple of one of [16, 32, 64, 128]"),
    (dict(device_capability=DeviceCapability(7, 5)), "is below 8.0"),
    (dict(use_mla=True), "MLA not supported"),
    (dict(attn_type="encoder_only"), "attention type encoder_only not supported"),
    (dict(use_per_head_quant_scales=True), "per-head quant scales not supported"),
])
def test_rejects_with_reason(change, reason):
    reasons = validate(**change)
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_block_size_multiple_splits_into_kernel_blocks():
    # vLLM splits a 256-token manager block into 128-token kernel blocks.
    assert validate(block_size=256) == []


def test_customize_spec_sizes_inline_nvfp4_pages(make_config):
    config = make_config()
    spec = _layer(config).get_kv_cache_spec(config)          # the real layer's spec
    assert spec.kv_quant_mode == KVQuantMode.NVFP4 and spec.dtype == torch.uint8
    packed = customize_attention_spec(Backend, spec)          # what vLLM's worker applies
    block, heads, d = spec.block_size, spec.num_kv_heads, spec.head_size
    assert packed.page_size_bytes == 2 * heads * block * (d // 2 + d // 16)
    assert packed.page_size_bytes == 2 * heads * block * d * 0.5625
    assert packed.page_size_bytes == 2 * heads * block * fmt.bytes_per_token_head(d)
    assert customize_attention_spec(Backend, packed) == packed  # applying twice changes nothing


def test_more_blocks_than_bf16_for_the_same_memory(make_config):
    config = make_config()
    specs = {f"layer{i}": customize_attention_spec(Backend, _layer(config).get_kv_cache_spec(config))
             for i in range(2)}
    names = [layout.name for layout in get_supported_kv_cache_layouts([Backend])]
    resolve_kv_cache_layout(config, [names], specs.values())
    bf16 = {name: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
            for name in specs}
    memory = 256 << 20
    nvfp4_blocks = get_kv_cache_configs(config, [specs], [memory])[0].num_blocks
    bf16_blocks = get_kv_cache_configs(config, [bf16], [memory])[0].num_blocks
    assert nvfp4_blocks / bf16_blocks == pytest.approx(4 / 1.125, rel=1e-3)  # 3.56x


def test_customize_spec_rejects_other_kv_dtypes():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype nvfp4"):
        Backend.customize_spec(spec)
    asym = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, head_size_v=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.NVFP4)
    with pytest.raises(ValueError, match="head_size_v=64"):
        Backend.customize_spec(asym)


def test_layouts_are_page_dense():
    layouts = Backend.supported_kv_cache_layouts()
    assert layouts[0] == KVCacheLayout.LBHNC
    assert all(layout.is_block_compact for layout in layouts)
    assert KVCacheLayout.LHBNC not in layouts and KVCacheLayout.BHLNC not in layouts


def test_cudagraph_support(make_config):
    config = make_config()
    spec = customize_attention_spec(Backend, _layer(config).get_kv_cache_spec(config))
    builder = Backend.get_builder_cls()
    assert builder.get_cudagraph_support(config, spec) == AttentionCGSupport.ALWAYS  # mixed batches too
    odd = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=96, dtype=torch.uint8,
                            kv_quant_mode=KVQuantMode.NVFP4)
    assert builder.get_cudagraph_support(config, odd) == AttentionCGSupport.NEVER  # no kernel for D=96


@pytest.mark.parametrize("kwargs, error", [
    (dict(alibi_slopes=[0.1] * 8), "ALiBi"),
    (dict(attn_type="encoder_only"), "decoder self-attention only"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(chunk_lookback=4), "chunk_lookback"),
])
def test_impl_rejects_unsupported_options(kwargs, error):
    args = dict(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2, kv_cache_dtype="nvfp4")
    with pytest.raises((NotImplementedError, ValueError), match=error):
        Backend.get_impl_cls()(**{**args, **kwargs})
