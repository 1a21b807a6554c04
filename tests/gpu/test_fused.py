"""The fused decode kernel (one block per SM, up to 8 kv heads per block) against the fp64 reference, and the
kernel each plan runs (skipped without a GPU)."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from kernel_checks import DEV, case_layout, check_decode
from nvfp4_backend import capabilities

pytestmark = pytest.mark.gpu


def _fused_cases():
    """The fused kernel (one block per heads_per_block kv heads, each warp on its own head's rows): both
    head dims, page sizes from 1 to 128, rows up to 8 (one row tile: plain decode and short spec) and up to
    16 (two: 4 query tokens at group 4), every heads-per-block each allows, kv head counts that leave
    the last block short or not, split-KV or not."""
    cases = []
    rows_cases = [(1, 1), (4, 1), (8, 1), (3, 2), (2, 4), (4, 2), (4, 4), (16, 1), (8, 2), (5, 3)]  # (group, q_len)
    for i, (head_dim, page_size, (group, q_len)) in enumerate(itertools.product([64, 128], [1, 16, 64, 128], rows_cases)):
        for heads_per_block in (1, 2, 4, 8):
            if capabilities.fused_allowed(head_dim, group, q_len, heads_per_block):
                num_kv_heads = [3, 5, 8][(i + heads_per_block) % 3]
                cases.append((head_dim, page_size, group, q_len, heads_per_block, num_kv_heads, [1, 5][(i + heads_per_block) % 2]))
    return cases


@pytest.mark.parametrize("head_dim,page_size,group,q_len,heads_per_block,num_kv_heads,splits", _fused_cases())
def test_decode_fused(head_dim, page_size, group, q_len, heads_per_block, num_kv_heads, splits, gen):
    layout = case_layout(head_dim + page_size + group + num_kv_heads, page_size)
    dtype = torch.bfloat16 if (page_size + num_kv_heads + q_len) % 2 else torch.float16
    check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads, splits=splits,
                 heads_per_block=heads_per_block, fused=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(37, None, False), (None, 30.0, False), (None, None, True),
                                                   (100, 20.0, True)])
@pytest.mark.parametrize("splits,q_len", [(1, 1), (5, 1), (1, 4), (5, 3)])
def test_decode_fused_features(dtype, window, soft_cap, sinks, splits, q_len, gen):
    """Window, soft cap and sinks in the fused kernel: 4 kv heads per block, 5 kv heads (the last block
    has one), one and two row tiles."""
    check_decode(gen, "HND", 128, 16, 4, q_len, dtype, num_kv_heads=5, window=window, soft_cap=soft_cap,
                 sinks=sinks, splits=splits, heads_per_block=4, fused=True)


@pytest.mark.parametrize("layout", ["HND", "NHD", "token_rows"])
@pytest.mark.parametrize("q_len, warps", [(1, 16), (4, 12), (1, 0)])
def test_plans_run_the_kernel_they_name(q_len, warps, layout, gen):
    """A fused plan runs the fused kernel (16 warps up to 8 rows per kv head, 12 up to 16: the kernel's
    fifth template argument; 0 the static kernel), not the static kernel the launcher falls back to on
    a device that lacks the block's shared memory; and a token-major cache (NHD pages, token rows) runs
    the kernel that copies whole token rows (the last argument)."""
    if warps and not capabilities.fused_fits(DEV):
        pytest.skip("this GPU gives a block less shared memory than the fused kernel takes")
    page_size = 1 if layout == "token_rows" else 16
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        check_decode(gen, layout, 128, page_size, 4, q_len, torch.bfloat16, 8, heads_per_block=4 if warps else 1,
                     fused=warps > 0)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if "paged_decode_kernel" in e.key]
    rows = layout != "HND"
    kernel = rf"(, ?{warps}, ?{str(rows).lower()}>|Li{warps}ELb{int(rows)}EE)"
    assert names and all(re.search(kernel, n) for n in names), names
