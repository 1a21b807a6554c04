"""CUDA kernels vs the reference, over the support matrix (skipped without a GPU).

Fresh random caches per case, pages in random order, outputs poisoned with NaN before each call.
"""
from __future__ import annotations

import itertools
import math
import os
import random
import re

import pytest
import torch

from nvfp4_backend import format as fmt, fuzz, jit, ops, reference
from nvfp4_backend.layout import KVMode, PagedKVCache
from gpu_cases import LAYOUTS, bad_values_case, fill_random, make_batch, make_cache, misaligned, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"
TOL = 4e-3  # relative L2 vs the fp64 reference on the same dequantized cache (bf16 queries)


@pytest.fixture
def gen(request):
    """Fresh data every run; the seed is printed (shown on failure) and NVFP4_TEST_SEED replays it."""
    seed = int(os.environ.get("NVFP4_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed {seed}: replay with NVFP4_TEST_SEED={seed} pytest '{request.node.nodeid}'")
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _scales(gen, n=2):
    return [torch.tensor(float(torch.empty(()).uniform_(0.05, 4.0, generator=gen)), device=DEV) for _ in range(n)]


# ----------------------------------------------------------------------------------- writer
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact(layout, head_dim, dtype, scale_rule, rotation, gen):
    """The CUDA writer == the CPU reference, bit for bit; with rotation the kernel's in-register
    Walsh-Hadamard transform == fmt.hadamard_transform (through the op's CPU implementation)."""
    _check_writer(layout, head_dim, dtype, scale_rule, rotation, gen, heads=4, page_size=16)


@pytest.mark.parametrize("layout", ["HND", "token_rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact_odd_shapes(layout, dtype, scale_rule, rotation, gen):
    """3 kv heads and pages of 12: the writer's token and page divisions that are not shifts."""
    _check_writer(layout, 128, dtype, scale_rule, rotation, gen, heads=3, page_size=12)


@pytest.mark.parametrize("heads,page_size", [(8, 16), (3, 12)])
@pytest.mark.parametrize("scale_rule", fmt.SCALE_RULES)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_write_kv_bit_exact_many_tokens(heads, page_size, scale_rule, rotation, gen):
    """Enough tokens that every thread of the writer's resident grid takes several steps (the grid
    is a whole number of tokens wide, also for 3 heads' 48 blocks per token)."""
    _check_writer("HND", 128, torch.bfloat16, scale_rule, rotation, gen, heads=heads, page_size=page_size,
                  tokens=20000)


def _check_writer(layout, head_dim, dtype, scale_rule, rotation, gen, heads, page_size, tokens=300):
    assert jit.kernels_available(torch.device(DEV))
    pages = -(-max(640, 2 * tokens) // page_size)
    x = torch.randn(2, tokens, heads, head_dim, generator=gen) * torch.rand(2, tokens, heads, 1, generator=gen) * 40
    x[0, 5, 1, 3] = 3000.0          # beyond 6 * 448 * g: saturates
    x[1, 7, 0, :16] = 1e-4          # tiny block: subnormal E4M3 scale
    x[0, 9, 2, 20] = float("inf")
    x[1, 11, heads - 1, 40] = float("nan")  # NaN block -> scale 0x7F
    key, value = x[0].to(dtype).to(DEV), x[1].to(dtype).to(DEV)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens]
    slots[::17] = -1                # padding
    slots = slots.to(DEV)
    kg, vg = _scales(gen)
    out_kernel, out_ref = make_cache(layout, pages, page_size, heads, head_dim, DEV), make_cache(layout, pages, page_size, heads, head_dim, DEV)
    for c in (out_kernel, out_ref):
        fill_random(c, gen)
    for a, b in zip(out_kernel.tensors(), out_ref.tensors()):
        b.copy_(a)
    torch.ops.nvfp4_backend.write_kv(key, value, slots, *out_kernel.tensors(), kg, vg, scale_rule, rotation)
    ref_cpu = _to_cpu(out_ref)  # the reference on the CPU: kernel == CPU reference, bit for bit
    torch.ops.nvfp4_backend.write_kv(key.cpu(), value.cpu(), slots.cpu(), *ref_cpu.tensors(), kg.cpu(), vg.cpu(),
                                     scale_rule, rotation)
    if scale_rule == "6or4" and rotation == "none":  # the rule must have chosen the maximum-of-4 scale somewhere
        six = _to_cpu(out_ref)
        reference.write_kv_ref(key.cpu(), value.cpu(), slots.cpu(), six, kg.cpu(), vg.cpu(), "6")
        assert not torch.equal(six.k_block_scales, ref_cpu.k_block_scales)
    for name, a, b in zip(("k_data", "k_scales", "v_data", "v_scales"), out_kernel.tensors(), ref_cpu.tensors()):
        diff = (a.cpu() != b).sum().item()
        assert diff == 0, f"{name}: {diff} bytes differ from the reference ({layout})"


def _to_cpu(cache):
    """A CPU copy of a cache with the same strides (one tensor per view)."""
    views = []
    for t in cache.tensors():
        cpu = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        cpu.copy_(t.cpu())
        views.append(cpu)
    return PagedKVCache(*views, mode=cache.mode)


@pytest.mark.parametrize("mode", [KVMode("6or4"), KVMode(rotation="hadamard"), KVMode("6or4", "hadamard")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["split", "single", "sinks", "many_rows", "many_splits", "packed", "packed_single",
                                  "fused", "fused_single", "fused_one_tile"])
def test_modes_end_to_end(mode, head_dim, dtype, case, gen):
    """A cache with an accuracy mode, written and read through the ops on the GPU: its bytes equal
    the CPU reference's quantization of fmt.hadamard_transform(K/V) (the writer rotates in its
    kernel), and attention (the kernel rotates q in and the output back) equals the fp64 reference
    on those bytes, given the rotated q rounded as the kernel rounds it, with the output rotated
    back exactly.  Cases: split-KV with speculative rows, one split, sinks, and the most rows a
    block serves (several row warps share the rotated-q buffer), 301 splits of 16-row blocks (the
    partial rows rotated back, then the merge), both kv heads in one block (plain decode, split
    and single), and both in one block of the fused kernel with 16 rows each (split and single) and
    with 4 (its 16-warp block, whose rotated rows lie inside the pipeline buffers; D 256 has no fused
    kernel: its plain two-head packing); rows past the batch untouched."""
    d, hkv, ps = head_dim, 2, 16
    group, q_len = {"many_rows": (16, jit.decode_max_rows(d) // 16), "many_splits": (4, 4),
                    "packed": (4, 1), "packed_single": (4, 1), "fused": (4, 4), "fused_single": (4, 4),
                    "fused_one_tile": (4, 1)}.get(case, (4, 2))
    fused = case.startswith("fused") and d <= 128
    if case.startswith("fused") and not fused:
        q_len = 1
    seq_lens, q_lens = [700, 33, 1500], [1, q_len, 1]
    cache = PagedKVCache.allocate(3 * 100, ps, hkv, d, device=DEV, mode=mode)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, hkv * group, d, ps, 300, dtype, gen, DEV)
    n = sum(seq_lens)
    kv = (torch.randn(2, n, hkv, d, generator=gen) * torch.rand(2, n, hkv, 1, generator=gen) * 8).to(dtype).to(DEV)
    slots = torch.cat([batch.block_table[b, torch.arange(s, device=DEV) // ps].long() * ps + torch.arange(s, device=DEV) % ps
                       for b, s in enumerate(seq_lens)])
    kg, vg = _scales(gen)
    want = _to_cpu(cache)  # before the write: bytes outside the slots must stay as they were
    ops.write_kv(kv[0], kv[1], slots, cache, kg, vg)
    hadamard = mode.rotation == "hadamard"
    written = (lambda x: fmt.hadamard_transform(x).to(x.dtype)) if hadamard else (lambda x: x)
    reference.write_kv_ref(written(kv[0].cpu()), written(kv[1].cpu()), slots.cpu(), want, kg.cpu(), vg.cpu(),
                           mode.scale_rule)
    for name, a, b in zip(("k_data", "k_scales", "v_data", "v_scales"), cache.tensors(), want.tensors()):
        assert torch.equal(a.cpu(), b), f"{name} differs from the reference quantization ({mode.name})"
    q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:], device=DEV).to(dtype)])  # 2 rows past the batch
    out = torch.full_like(q, float("nan"))
    sinks = torch.randn(hkv * group, generator=gen).to(DEV) if case == "sinks" else None
    plan = ops.plan_attention(3, hkv, group, max(q_lens), max(seq_lens), d, ops.num_sms(torch.device(DEV)),
                              heads_per_block=2 if case.startswith(("packed", "fused")) else None, fused=fused)
    if case.endswith("single"):
        plan = ops.AttentionPlan(1, 0, plan.heads_per_block, plan.fused)
    if case == "many_splits":
        plan = ops.AttentionPlan(301, 3 * hkv * 301 * q_len * group * (d + 2) * 4)
    assert (plan.num_splits > 1) == (not case.endswith("single"))  # partial rows are rotated back too
    assert (plan.heads_per_block > 1) == case.startswith(("packed", "fused")) and plan.fused == fused
    ops.paged_attention(q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.09, out=out,
                        max_query_len=max(q_lens), plan=plan, sinks=sinks)
    h = fmt.hadamard(d, DEV, torch.float64) if hadamard else torch.eye(d, dtype=torch.float64, device=DEV)
    q_in = written(batch.q).double()  # what the kernel's MMA sees: x H rounded to the query dtype
    plain = PagedKVCache(*cache.tensors())
    ref = reference.paged_attention_ref(q_in, plain, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                                        0.09, sinks=sinks, dtype=torch.float64) @ h
    rows = batch.q.shape[0]
    assert rel_l2(out[:rows].float(), ref) < TOL
    assert torch.isnan(out[rows:]).all()


# ----------------------------------------------------------------------------------- decode
def _case_layout(index: int, page_size: int) -> str:
    """LAYOUTS[index], rotating through the layouts case by case; vLLM pages hold >= 16 tokens, and
    1-token inline pages are not 16-byte aligned, so those take SGLang's token rows."""
    layout = LAYOUTS[index % len(LAYOUTS)]
    return "token_rows" if page_size == 1 and layout.startswith("inline") else layout


def _cases():
    """The support matrix, each axis value covered, with the combinations that stress indexing."""
    cases = []
    for head_dim, page_size, group, q_len in itertools.product([64, 128, 256], [1, 16, 32, 64, 128], [1, 4, 8, 16], [1, 2, 4, 8]):
        if q_len * group > jit.decode_max_rows(head_dim):
            continue
        cases.append((head_dim, page_size, group, q_len))
    return cases


@pytest.mark.parametrize("head_dim,page_size,group,q_len", _cases())
def test_decode_matrix(head_dim, page_size, group, q_len, gen):
    layout = _case_layout(head_dim + page_size + group + q_len, page_size)
    dtype = torch.bfloat16 if (page_size + q_len) % 2 else torch.float16
    _check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads=2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(None, None, False), (37, None, False), (None, 30.0, False),
                                                   (None, None, True), (100, 20.0, True)])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_features(layout, dtype, window, soft_cap, sinks, splits, gen):
    _check_decode(gen, layout, 128, 16, 4, 3, dtype, num_kv_heads=3, window=window, soft_cap=soft_cap,
                  sinks=sinks, splits=splits)


def _packed_cases():
    """Blocks of 2 or 4 kv heads (plain decode): each head dim, page sizes from 1 to 128, every group
    whose packed rows fit 8 (3: rows per head not a power of two), kv head counts that leave the last
    block short (3, 5) or not, and split-KV, which writes each head's partial rows."""
    cases = []
    for i, (head_dim, page_size, (group, heads_per_block), num_kv_heads) in enumerate(itertools.product(
            [64, 128, 256], [1, 16, 64, 128], [(1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (4, 2)], [3, 4, 5])):
        cases.append((head_dim, page_size, group, heads_per_block, num_kv_heads, [1, 5][i % 2]))
    return cases


@pytest.mark.parametrize("head_dim,page_size,group,heads_per_block,num_kv_heads,splits", _packed_cases())
def test_decode_packed_heads(head_dim, page_size, group, heads_per_block, num_kv_heads, splits, gen):
    layout = _case_layout(head_dim + page_size + group + num_kv_heads, page_size)
    dtype = torch.bfloat16 if (page_size + num_kv_heads) % 2 else torch.float16
    _check_decode(gen, layout, head_dim, page_size, group, 1, dtype, num_kv_heads, splits=splits,
                  heads_per_block=heads_per_block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(37, None, False), (None, 30.0, False), (None, None, True),
                                                   (100, 20.0, True)])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_packed_heads_features(dtype, window, soft_cap, sinks, splits, gen):
    """Window, soft cap and sinks with 4 kv heads per block, 5 kv heads (the last block has one)."""
    _check_decode(gen, "HND", 128, 16, 2, 1, dtype, num_kv_heads=5, window=window, soft_cap=soft_cap,
                  sinks=sinks, splits=splits, heads_per_block=4)


def _fused_cases():
    """The fused kernel (one block per heads_per_block kv heads, each warp on its own head's rows): both
    head dims, page sizes from 1 to 128, rows up to 8 (one row tile: plain decode and short spec) and up to
    16 (two: 4 query tokens at group 4), every heads-per-block each allows, kv head counts that leave
    the last block short or not, split-KV or not."""
    cases = []
    rows_cases = [(1, 1), (4, 1), (8, 1), (3, 2), (2, 4), (4, 2), (4, 4), (16, 1), (8, 2), (5, 3)]  # (group, q_len)
    for i, (head_dim, page_size, (group, q_len)) in enumerate(itertools.product([64, 128], [1, 16, 64, 128], rows_cases)):
        for heads_per_block in (1, 2, 4, 8):
            if ops.fused_allowed(head_dim, group, q_len, heads_per_block):
                num_kv_heads = [3, 5, 8][(i + heads_per_block) % 3]
                cases.append((head_dim, page_size, group, q_len, heads_per_block, num_kv_heads, [1, 5][(i + heads_per_block) % 2]))
    return cases


@pytest.mark.parametrize("head_dim,page_size,group,q_len,heads_per_block,num_kv_heads,splits", _fused_cases())
def test_decode_fused(head_dim, page_size, group, q_len, heads_per_block, num_kv_heads, splits, gen):
    layout = _case_layout(head_dim + page_size + group + num_kv_heads, page_size)
    dtype = torch.bfloat16 if (page_size + num_kv_heads + q_len) % 2 else torch.float16
    _check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads, splits=splits,
                  heads_per_block=heads_per_block, fused=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(37, None, False), (None, 30.0, False), (None, None, True),
                                                   (100, 20.0, True)])
@pytest.mark.parametrize("splits,q_len", [(1, 1), (5, 1), (1, 4), (5, 3)])
def test_decode_fused_features(dtype, window, soft_cap, sinks, splits, q_len, gen):
    """Window, soft cap and sinks in the fused kernel: 4 kv heads per block, 5 kv heads (the last block
    has one), one and two row tiles."""
    _check_decode(gen, "HND", 128, 16, 4, q_len, dtype, num_kv_heads=5, window=window, soft_cap=soft_cap,
                  sinks=sinks, splits=splits, heads_per_block=4, fused=True)


@pytest.mark.parametrize("layout", ["HND", "NHD", "token_rows"])
@pytest.mark.parametrize("q_len, warps", [(1, 16), (4, 12), (1, 0)])
def test_plans_run_the_kernel_they_name(q_len, warps, layout, gen):
    """A fused plan runs the fused kernel (16 warps up to 8 rows per kv head, 12 up to 16: its fourth
    template argument), not the static kernel the launcher falls back to on a device that lacks the
    block's shared memory; and a token-major cache (NHD pages, token rows) runs the kernel that copies
    whole token rows (either kernel's last argument)."""
    if warps and not ops.fused_fits(DEV):
        pytest.skip("this GPU gives a block less shared memory than the fused kernel takes")
    page_size = 1 if layout == "token_rows" else 16
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _check_decode(gen, layout, 128, page_size, 4, q_len, torch.bfloat16, 8, heads_per_block=4 if warps else 1,
                      fused=warps > 0)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if re.search(r"paged_decode_(static|fused)_kernel", e.key)]
    rows = layout != "HND"
    last = (rf", ?{warps}, ?{str(rows).lower()}>|Li{warps}ELb{int(rows)}EE" if warps
            else rf", ?{str(rows).lower()}>|Lb{int(rows)}EE")
    kernel = rf"paged_decode_{'fused' if warps else 'static'}_kernel.*({last})"
    assert names and all(re.search(kernel, n) for n in names), names


# ----------------------------------------------------------------------------- extend (prefill) path
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_kv_bit_exact(layout, head_dim, dtype, gen):
    """The gather kernel's packed rows == the reference's dequantization (no global scale), bit for
    bit, over every scale byte (NaN, zero and subnormal scales included); every row is written."""
    page_size = 1 if layout == "token_rows" else 16
    seq_lens = [0, 1, 37, 300, 16 * int(torch.randint(1, 20, (), generator=gen))]
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, 3, head_dim, DEV)
    fill_random(cache, gen, 0, 256)
    assert ops._gather_kernel_serves(cache)
    batch = make_batch(seq_lens, [1] * len(seq_lens), 3, head_dim, page_size, pages, dtype, gen, DEV)
    starts = [0] + list(itertools.accumulate(seq_lens))
    k = torch.full((starts[-1], 3, head_dim), float("nan"), dtype=dtype, device=DEV)
    v = torch.full_like(k, float("nan"))
    jit.load(torch.device(DEV)).gather_kv(*cache.tensors(), batch.block_table, batch.seq_lens,
                                          torch.tensor(starts[:-1], device=DEV), max(seq_lens), k, v)
    one = torch.tensor(1.0, device=DEV)
    k_ref, v_ref = reference.gather_kv_ref(cache, batch.block_table, batch.seq_lens, one, one, dtype)
    for got, ref in ((k, k_ref), (v, v_ref)):
        want = torch.cat([ref[b, :n] for b, n in enumerate(seq_lens)])
        nan = torch.isnan(want)
        assert nan.any() and torch.equal(torch.isnan(got), nan), "NaN pattern differs (or a row was not written)"
        bits_got, bits_want = got.view(torch.int16), want.view(torch.int16)
        assert torch.equal(bits_got[~nan], bits_want[~nan]), f"{int((bits_got != bits_want)[~nan].sum())} values differ"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gather_tokens", [100, 1 << 16])
def test_extend_path_matches_reference(layout, dtype, gather_tokens, gen, monkeypatch):
    """Prefill and chunked prefill past the decode kernel's rows (gather kernel + SDPA), requests
    dequantized one per launch or together, a request without queries in the batch."""
    monkeypatch.setattr(ops, "EXTEND_GATHER_TOKENS", gather_tokens)
    page_size, kv_heads, group, head_dim = (1 if layout == "token_rows" else 16), 2, 4, 128
    seq_lens, q_lens = [300, 700, 90, 129], [300, 200, 0, 129]  # prefill, chunked prefill, idle, prefill
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, kv_heads * group, head_dim, page_size, pages, dtype, gen, DEV)
    kg, vg = _scales(gen)
    assert not jit.decode_supports(group, batch.max_query_len, head_dim)  # the dense path serves it
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                        1 / math.sqrt(head_dim), max_query_len=batch.max_query_len, out=out)
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, 1 / math.sqrt(head_dim), dtype=torch.float64)
    assert not torch.isnan(out).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out, ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL} ({layout}, {dtype})"


def _check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads, window=None, soft_cap=None,
                  sinks=False, splits=None, seq_lens=None, heads_per_block=1, fused=False):
    seq_lens = seq_lens or [q_len + int(x) for x in torch.randint(0, 700, (4,), generator=gen)]
    seq_lens[0] = q_len  # only the new tokens
    q_lens = [q_len] * len(seq_lens)
    q_lens[1] = max(1, q_len - 1)  # ragged q_len inside one batch
    pages = sum(math.ceil(s / page_size) for s in seq_lens) + 3
    cache = make_cache(layout, pages, page_size, num_kv_heads, head_dim, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, num_kv_heads * group, head_dim, page_size, pages, dtype, gen, DEV)
    kg, vg = _scales(gen)
    sink_t = torch.randn(num_kv_heads * group, generator=gen).to(DEV) if sinks else None
    scale = 1 / math.sqrt(head_dim)
    plan = ops.plan_attention(len(seq_lens), num_kv_heads, group, batch.max_query_len, max(seq_lens), head_dim,
                              heads_per_block=heads_per_block, fused=fused)
    if splits is not None:
        plan = ops.AttentionPlan(splits, len(seq_lens) * num_kv_heads * splits * q_len * group * (head_dim + 2) * 4,
                                 heads_per_block, fused)
    assert plan.heads_per_block == heads_per_block and plan.fused == fused
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, scale,
                        max_query_len=batch.max_query_len, sliding_window=window, logits_soft_cap=soft_cap,
                        sinks=sink_t, out=out, plan=plan)
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, scale, window, soft_cap, sink_t, dtype=torch.float64)
    assert not torch.isnan(out).any(), "an output element was not written (or is NaN)"
    err = rel_l2(out, ref)
    assert err <= TOL, f"relative L2 error {err:.2e} > {TOL} ({layout}, D={head_dim}, ps={page_size}, G={group}, q={q_len})"


def test_long_context_split(gen):
    """One long request must use split-KV and still match the reference."""
    _check_decode(gen, "NHD", 128, 64, 4, 1, torch.bfloat16, num_kv_heads=2, seq_lens=[40000, 1, 333, 5000])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("q_len", [2, 4])
def test_many_splits(head_dim, sinks, q_len, gen):
    """More splits than one round of the merge's loads takes (301: two rounds at head dim 64, three
    at 128, five at 256, the last one partial), many of them empty (past a request's end), for each
    head dim's thread groups in the merge; 8 rows (the 1-row-tile kernel) and 16 (two row tiles or
    two row warps).  The other split tests take one round, with one group (5 splits) or several."""
    _check_decode(gen, "HND", head_dim, 16, 4, q_len, torch.bfloat16, num_kv_heads=2, sinks=sinks, splits=301,
                  seq_lens=[q_len, 5000, 700, 40])


def test_binding_rejects_bad_arguments(gen):
    """The binding's own checks, behind the Python ops': too many splits, a misaligned split
    workspace, too many rows, a float32 or CPU query, kv heads per block that are not 1, 2, 4 or
    whose rows do not fit, a bad scale rule are RuntimeErrors naming the argument (not a crash), and
    nothing is written."""
    cache = make_cache("HND", 64, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch([300, 40], [1, 1], 8, 128, 16, 64, torch.bfloat16, gen, DEV)
    kg, vg = _scales(gen)
    kernels = jit.load(torch.device(DEV))
    workspace = torch.empty(2 * 2 * (ops.MAX_SPLITS + 1) * 4 * 130 * 4 + 16, dtype=torch.uint8, device=DEV)
    # the messages that format numbers, dtypes and devices matter most: see text() in csrc/binding.cpp
    q32 = batch.q.float()
    cases = [  # (q, num_splits, workspace, max_query_len, heads_per_block, message)
        (batch.q, ops.MAX_SPLITS + 1, workspace, 1, 1,
         rf"num_splits must lie in \[1, {ops.MAX_SPLITS}\], got {ops.MAX_SPLITS + 1}"),
        (batch.q, 2, workspace[4:], 1, 1, "workspace must be 16-byte aligned"),
        (batch.q, 1, workspace, 100, 1, r"max_query_len \* group_size = 400 exceeds the decode kernel's 64 rows at head_dim 128"),
        (q32, 1, workspace, 1, 1, "q must be float16 or bfloat16, got Float"),
        (batch.q.cpu(), 1, workspace, 1, 1, "q must be a CUDA tensor, got cpu"),
        (batch.q, 1, workspace, 1, 3, r"heads_per_block must be 1, 2 or 4 \(or 8 with fused\), got 3"),
        (batch.q, 1, workspace, 1, 8, r"heads_per_block must be 1, 2 or 4 \(or 8 with fused\), got 8"),
        (misaligned(batch.q), 1, workspace, 1, 1,
         r"q rows must be 16-byte aligned .*got a data pointer 2 bytes past a 16-byte boundary and strides \[1024, 128, 1\]"),
        (batch.q, 1, workspace, 1, 4, "heads_per_block 4 needs max_query_len 1 and heads_per_block \\* group_size <= 8, "
                                      "got max_query_len 1 and group_size 4"),
        (batch.q, 1, workspace, 2, 2, "heads_per_block 2 needs max_query_len 1 .*got max_query_len 2 and group_size 4")]
    fused_cases = [  # the fused kernel: up to 16 rows, up to 4 kv heads per block past 8 rows
        (batch.q, 1, workspace, 5, 1, "fused needs head_dim 64 or 128 and max_query_len \\* group_size <= 16 .*got head_dim "
                                      "128, 20 rows and heads_per_block 1"),
        (batch.q, 1, workspace, 4, 8, "fused needs .*got head_dim 128, 16 rows and heads_per_block 8")]
    for q, num_splits, ws, max_query_len, heads_per_block, message, fused in (
            [c + (False,) for c in cases] + [c + (True,) for c in fused_cases]):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEV)
        with pytest.raises(RuntimeError, match=message):
            kernels.paged_attention(out, q, *cache.tensors(), batch.block_table, batch.seq_lens,
                                    batch.query_start_loc, kg, vg, 0.1, 0, 0.0, None, max_query_len, num_splits, ws,
                                    "none", heads_per_block, fused)
        torch.cuda.synchronize()
        assert out.isnan().all(), "out was written although the call was rejected"
    out = misaligned(torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=DEV))
    with pytest.raises(RuntimeError, match="out rows must be 16-byte aligned"):
        kernels.paged_attention(out, batch.q, *cache.tensors(), batch.block_table, batch.seq_lens,
                                batch.query_start_loc, kg, vg, 0.1, 0, 0.0, None, 1, 1, workspace, "none", 1)
    torch.cuda.synchronize()
    assert out.isnan().all(), "out was written although the call was rejected"
    before = [t.clone() for t in cache.tensors()]
    k = torch.randn(3, 2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match='scale_rule must be "6" or "6or4", got 7'):
        kernels.write_kv(k, k, torch.arange(3, device=DEV), *cache.tensors(), kg, vg, "7", "none")
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors())), "the cache was written"


@pytest.mark.parametrize("heads_per_block,fused", [(1, False), (2, False), (2, True)])
def test_cuda_graph_replay_and_determinism(heads_per_block, fused, gen):
    seq_lens, q_lens = [500, 1200, 77], [1, 1, 1]
    cache = make_cache("HND", 200, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, q_lens, 8, 128, 16, 200, torch.bfloat16, gen, DEV)
    kg, vg = _scales(gen)
    plan = ops.plan_attention(3, 2, 4, 1, 1200, 128, heads_per_block=heads_per_block, fused=fused)
    assert plan.num_splits > 1 and plan.fused == fused
    ws = plan.allocate_workspace(DEV)
    out = torch.empty_like(batch.q)

    def step():
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1,
                            max_query_len=1, out=out, plan=plan, workspace=ws)

    step()
    eager = out.clone()
    step()
    assert torch.equal(out, eager), "two identical calls differ (non-deterministic merge)"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm up on the capture stream
        graph = torch.cuda.CUDAGraph()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager"
    q2 = torch.randn_like(batch.q)
    batch.q.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    step()
    assert torch.equal(out, out.clone())


def test_flashinfer_cross_check(gen):
    flashinfer = pytest.importorskip("flashinfer")
    B, L, ps, hkv, group, D = 4, 777, 16, 2, 4, 128
    cache = make_cache("NHD", B * math.ceil(L / ps) + 1, ps, hkv, D, DEV)
    fill_random(cache, gen)
    batch = make_batch([L] * B, [1] * B, hkv * group, D, ps, cache.num_pages, torch.bfloat16, gen, DEV)
    kg, vg = _scales(gen)
    ours = ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                               1 / math.sqrt(D), max_query_len=1)
    npp = math.ceil(L / ps)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(torch.arange(B + 1, device=DEV, dtype=torch.int32) * npp, batch.block_table.flatten(),
           torch.full((B,), L - (npp - 1) * ps, device=DEV, dtype=torch.int32), hkv * group, hkv, D, ps,
           q_data_type=torch.bfloat16, kv_data_type=torch.uint8)
    theirs = w.run(batch.q, (cache.k_data, cache.v_data), k_scale=float(kg), v_scale=float(vg),
                   kv_cache_sf=(cache.k_block_scales.view(torch.float8_e4m3fn), cache.v_block_scales.view(torch.float8_e4m3fn)))
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                                        kg, vg, 1 / math.sqrt(D), dtype=torch.float64)
    err_ours, err_theirs = rel_l2(ours, ref), rel_l2(theirs, ref)
    print(f"rel L2 vs fp64 reference: nvfp4-backend {err_ours:.2e}, FlashInfer fa2 {err_theirs:.2e}")
    assert err_ours <= max(err_theirs * 1.5, TOL)


# ----------------------------------------------------------------------------------- hardening
@pytest.mark.parametrize("seed", range(48))
def test_fuzz_fixed_seeds(seed):
    """A fixed-seed subset of ``nvfp4-backend fuzz`` (the 1000-configuration runs are in results/)."""
    rec = fuzz.run_config(fuzz.generate(seed, max_context=32768), torch.device(DEV))
    assert rec["ok"], f"{rec['summary']}: {rec['failure']} (replay: nvfp4-backend fuzz --replay {seed} --max-context 32768)"


@pytest.mark.parametrize("heads_per_block,fused", [(1, False), (2, False), (2, True)])
def test_bad_values_give_the_reference_nan_pattern(heads_per_block, fused, gen):
    """NaN K / V blocks, a NaN query, all-zero blocks and NaN stale bytes: the kernel's output has
    exactly the reference's NaN pattern (README, Reliability) and matches it elsewhere; with both
    kv heads in one block too (a NaN of one head must not reach the other's rows)."""
    case = bad_values_case(DEV, gen)
    b = case.batch
    out = torch.full_like(case.q, 7.0)
    plan = ops.plan_attention(b.seq_lens.shape[0], case.cache.num_kv_heads, case.q.shape[1] // case.cache.num_kv_heads,
                              1, int(b.seq_lens.max()), case.q.shape[2], heads_per_block=heads_per_block, fused=fused)
    assert plan.fused == fused
    ops.paged_attention(case.q, case.cache, b.block_table, b.seq_lens, b.query_start_loc, case.kg, case.vg, 0.1,
                        out=out, plan=plan, max_query_len=1)
    assert torch.equal(torch.isnan(out).cpu(), case.expect_nan)
    assert torch.equal(out[case.zero_rows], torch.zeros_like(out[case.zero_rows]))
    ref = reference.paged_attention_ref(case.q, case.cache, b.block_table, b.seq_lens, b.query_start_loc, case.kg,
                                        case.vg, 0.1, dtype=torch.float64)
    finite = ~case.expect_nan.to(DEV)
    assert rel_l2(out[finite].float(), ref[finite]) < TOL


def _devices():
    return [pytest.param(i, marks=pytest.mark.skipif(torch.cuda.device_count() <= i, reason=f"needs {i + 1} GPUs"))
            for i in (0, 1)]


@pytest.mark.parametrize("index", _devices())
def test_runs_on_the_tensors_device_and_current_stream(index, gen):
    """Inputs on GPU ``index`` while the current device is GPU 0, on a side stream of GPU
    ``index`` whose queue is busy (a sleep) before the query is written: the ops must run on that
    stream (else they read the old query or race the writer), and a CUDA graph captured there
    must replay correctly."""
    dev = torch.device("cuda", index)
    torch.cuda.set_device(0)
    seq_lens, hkv, group, d, ps = [300, 1200, 77], 2, 4, 128, 16
    cache = make_cache("HND", 200, ps, hkv, d, dev)
    fill_random(cache, gen)
    batch = make_batch(seq_lens, [1, 1, 1], hkv * group, d, ps, 200, torch.bfloat16, gen, dev)
    kg, vg = (torch.tensor(x, device=dev) for x in (0.5, 0.25))
    new_q = torch.randn(batch.q.shape, generator=gen).to(torch.bfloat16).to(dev)
    key = torch.randn(3, hkv, d, generator=gen).to(torch.bfloat16).to(dev)
    slots = torch.tensor([int(batch.block_table[b, (s - 1) // ps]) * ps + (s - 1) % ps
                          for b, s in enumerate(seq_lens)], device=dev)
    plan = ops.plan_attention(3, hkv, group, 1, 1200, d)
    ws = plan.allocate_workspace(dev)
    out = torch.full_like(batch.q, float("nan"))
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # the inputs above were made on the default stream
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work ahead of the writes below
        batch.q.copy_(new_q)
        ops.write_kv(key, key, slots, cache, kg, vg)
        ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.1,
                            max_query_len=1, out=out, plan=plan, workspace=ws)
    stream.synchronize()
    ref = reference.paged_attention_ref(new_q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg,
                                        vg, 0.1, dtype=torch.float64)
    assert rel_l2(out.float(), ref) < TOL
    # the extend path (gather kernel + SDPA) on that device: 64 new rows of request 1 (its host
    # reads of the lengths wait for the queued work, so this part checks the device, not the stream)
    ext_q = torch.randn(64, hkv * group, d, generator=gen).to(torch.bfloat16).to(dev)
    ext_qsl = torch.tensor([0, 0, 64, 64], dtype=torch.int32, device=dev)
    ext_out = torch.full_like(ext_q, float("nan"))
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        ext_q.mul_(2.0)  # queued behind the sleep: work on another stream would read the old rows
        ops.paged_attention(ext_q, cache, batch.block_table, batch.seq_lens, ext_qsl, kg, vg, 0.1, max_query_len=64,
                            out=ext_out)
    stream.synchronize()
    ref = reference.paged_attention_ref(ext_q, cache, batch.block_table, batch.seq_lens, ext_qsl, kg, vg, 0.1,
                                        dtype=torch.float64)
    assert rel_l2(ext_out.float(), ref) < TOL
    # the gather kernel on that stream, no host read in between: the bytes it must read are written
    # behind a sleep on the same stream
    starts = torch.tensor([0, 300, 1500], device=dev)  # first output row per request (300, 1200, 77)
    rows_k = torch.full((sum(seq_lens), hkv, d), float("nan"), dtype=torch.float16, device=dev)
    rows_v = torch.full_like(rows_k, float("nan"))
    new_bytes = torch.randint(0, 256, cache.k_data.shape, generator=gen, dtype=torch.uint8).to(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        cache.k_data.copy_(new_bytes)
        jit.load(dev).gather_kv(*cache.tensors(), batch.block_table, batch.seq_lens, starts, max(seq_lens), rows_k,
                                rows_v)
    stream.synchronize()
    one = torch.tensor(1.0, device=dev)
    k_ref, _ = reference.gather_kv_ref(cache, batch.block_table, batch.seq_lens, one, one, torch.float16)
    want = torch.cat([k_ref[b, :n] for b, n in enumerate(seq_lens)])
    assert torch.equal(rows_k.view(torch.int16), want.view(torch.int16)), "gather_kv read the cache before the write"
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg,
                                0.1, max_query_len=1, out=out, plan=plan, workspace=ws)
        out.fill_(float("nan"))
        batch.q.copy_(torch.randn(batch.q.shape, generator=gen).to(torch.bfloat16).to(dev))
        graph.replay()
    stream.synchronize()
    ref = reference.paged_attention_ref(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg,
                                        vg, 0.1, dtype=torch.float64)
    assert rel_l2(out.float(), ref) < TOL


@pytest.mark.parametrize("batch_size,seq_len", [(1, 262144), (8, 131072)], ids=["1x256K", "8x128K(1M)"])
def test_long_contexts(batch_size, seq_len, gen):
    """262144 tokens in one request and 1M across a batch, 8 kv heads (split-KV at its longest);
    checked against the fp64 reference on two sampled kv heads (8 query heads)."""
    hkv, group, d, ps = 8, 4, 128, 16
    pages = batch_size * seq_len // ps + 1
    cache = make_cache("HND", pages, ps, hkv, d, DEV)
    fill_random(cache, gen)
    batch = make_batch([seq_len] * batch_size, [1] * batch_size, hkv * group, d, ps, pages, torch.bfloat16, gen, DEV)
    kg, vg = _scales(gen)
    out = torch.full_like(batch.q, float("nan"))
    ops.paged_attention(batch.q, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, kg, vg, 0.088,
                        max_query_len=1, out=out)
    assert torch.isfinite(out).all()
    for h in sorted(torch.randperm(hkv, generator=gen)[:2].tolist()):
        sub = PagedKVCache(*(t[:, :, h:h + 1] for t in cache.tensors()))
        rows = slice(h * group, (h + 1) * group)
        ref = reference.paged_attention_ref(batch.q[:, rows], sub, batch.block_table, batch.seq_lens,
                                            batch.query_start_loc, kg, vg, 0.088, dtype=torch.float64)
        assert rel_l2(out[:, rows].float(), ref) < TOL, f"kv head {h}"
