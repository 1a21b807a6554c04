"""The CUDA writer (quantize-on-write) against the CPU reference, bit for bit (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import LAYOUTS
from kernel_checks import check_writer
from nvfp4_backend import format as fmt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact(layout, head_dim, dtype, scale_rule, rotation, gen):
    """The CUDA writer == the CPU reference, bit for bit; with rotation the kernel's in-register
    Walsh-Hadamard transform == fmt.hadamard_transform (through the op's CPU implementation)."""
    check_writer(layout, head_dim, dtype, scale_rule, rotation, gen, heads=4, page_size=16)


@pytest.mark.parametrize("layout", ["HND", "token_rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact_odd_shapes(layout, dtype, scale_rule, rotation, gen):
    """3 kv heads and pages of 12: the writer's token and page divisions that are not shifts."""
    check_writer(layout, 128, dtype, scale_rule, rotation, gen, heads=3, page_size=12)


@pytest.mark.parametrize("heads,page_size", [(8, 16), (3, 12)])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact_many_tokens(heads, page_size, scale_rule, rotation, gen):
    """Enough tokens that every thread of the writer's resident grid takes several steps (the grid
    is a whole number of tokens wide, also for 3 heads' 48 blocks per token)."""
    check_writer("HND", 128, torch.bfloat16, scale_rule, rotation, gen, heads=heads, page_size=page_size,
                 tokens=20000)
