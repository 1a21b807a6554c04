"""The static decode kernels against the fp64 reference over the support matrix, the accuracy modes end to
end, bad values, long contexts, the binding's own checks (skipped without a GPU).

Fresh random caches per case, pages in random order, outputs poisoned with NaN before each call.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from gpu_cases import LAYOUTS, bad_values_case, fill_random, make_batch, make_cache, misaligned, rel_l2
from kernel_checks import DEV, TOL, case_layout, check_decode, scales, to_cpu
from nvfp4_backend import capabilities, jit, ops, planner, reference
from nvfp4_backend import format as fmt
from nvfp4_backend.layout import PagedKVCache
from nvfp4_backend.modes import KVMode
from nvfp4_backend.tools import fuzz

pytestmark = pytest.mark.gpu


def _cases():
    """The support matrix, each axis value covered, with the combinations that stress indexing."""
    cases = []
    for head_dim, page_size, group, q_len in itertools.product([64, 128, 256], [1, 16, 32, 64, 128], [1, 4, 8, 16], [1, 2, 4, 8]):
        if q_len * group > capabilities.decode_max_rows(head_dim):
            continue
        cases.append((head_dim, page_size, group, q_len))
    return cases


@pytest.mark.parametrize("head_dim,page_size,group,q_len", _cases())
def test_decode_matrix(head_dim, page_size, group, q_len, gen):
    layout = case_layout(head_dim + page_size + group + q_len, page_size)
    dtype = torch.bfloat16 if (page_size + q_len) % 2 else torch.float16
    check_decode(gen, layout, head_dim, page_size, group, q_len, dtype, num_kv_heads=2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(None, None, False), (37, None, False), (None, 30.0, False),
                                                   (None, None, True), (100, 20.0, True)])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_features(layout, dtype, window, soft_cap, sinks, splits, gen):
    check_decode(gen, layout, 128, 16, 4, 3, dtype, num_kv_heads=3, window=window, soft_cap=soft_cap,
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
    layout = case_layout(head_dim + page_size + group + num_kv_heads, page_size)
    dtype = torch.bfloat16 if (page_size + num_kv_heads) % 2 else torch.float16
    check_decode(gen, layout, head_dim, page_size, group, 1, dtype, num_kv_heads, splits=splits,
                 heads_per_block=heads_per_block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,soft_cap,sinks", [(37, None, False), (None, 30.0, False), (None, None, True),
                                                   (100, 20.0, True)])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_packed_heads_features(dtype, window, soft_cap, sinks, splits, gen):
    """Window, soft cap and sinks with 4 kv heads per block, 5 kv heads (the last block has one)."""
    check_decode(gen, "HND", 128, 16, 2, 1, dtype, num_kv_heads=5, window=window, soft_cap=soft_cap,
                 sinks=sinks, splits=splits, heads_per_block=4)


def test_long_context_split(gen):
    """One long request must use split-KV and still match the reference."""
    check_decode(gen, "NHD", 128, 64, 4, 1, torch.bfloat16, num_kv_heads=2, seq_lens=[40000, 1, 333, 5000])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("q_len", [2, 4])
def test_many_splits(head_dim, sinks, q_len, gen):
    """More splits than one round of the merge's loads takes (301: two rounds at head dim 64, three
    at 128, five at 256, the last one partial), many of them empty (past a request's end), for each
    head dim's thread groups in the merge; 8 rows (the 1-row-tile kernel) and 16 (two row tiles or
    two row warps).  The other split tests take one round, with one group (5 splits) or several."""
    check_decode(gen, "HND", head_dim, 16, 4, q_len, torch.bfloat16, num_kv_heads=2, sinks=sinks, splits=301,
                 seq_lens=[q_len, 5000, 700, 40])


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
    group, q_len = {"many_rows": (16, capabilities.decode_max_rows(d) // 16), "many_splits": (4, 4),
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
    kg, vg = scales(gen)
    want = to_cpu(cache)  # before the write: bytes outside the slots must stay as they were
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
    plan = planner.plan_attention(3, hkv, group, max(q_lens), max(seq_lens), d, planner.num_sms(torch.device(DEV)),
                                  heads_per_block=2 if case.startswith(("packed", "fused")) else None, fused=fused)
    if case.endswith("single"):
        plan = planner.AttentionPlan(1, 0, plan.heads_per_block, plan.fused)
    if case == "many_splits":
        plan = planner.AttentionPlan(301, 3 * hkv * 301 * q_len * group * (d + 2) * 4)
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


@pytest.mark.parametrize("heads_per_block,fused", [(1, False), (2, False), (2, True)])
def test_bad_values_give_the_reference_nan_pattern(heads_per_block, fused, gen):
    """NaN K / V blocks, a NaN query, all-zero blocks and NaN stale bytes: the kernel's output has
    exactly the reference's NaN pattern (README, Reliability) and matches it elsewhere; with both
    kv heads in one block too (a NaN of one head must not reach the other's rows)."""
    case = bad_values_case(DEV, gen)
    b = case.batch
    out = torch.full_like(case.q, 7.0)
    plan = planner.plan_attention(b.seq_lens.shape[0], case.cache.num_kv_heads, case.q.shape[1] // case.cache.num_kv_heads,
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


@pytest.mark.parametrize("batch_size,seq_len", [(1, 262144), (8, 131072)], ids=["1x256K", "8x128K(1M)"])
def test_long_contexts(batch_size, seq_len, gen):
    """262144 tokens in one request and 1M across a batch, 8 kv heads (split-KV at its longest);
    checked against the fp64 reference on two sampled kv heads (8 query heads)."""
    hkv, group, d, ps = 8, 4, 128, 16
    pages = batch_size * seq_len // ps + 1
    cache = make_cache("HND", pages, ps, hkv, d, DEV)
    fill_random(cache, gen)
    batch = make_batch([seq_len] * batch_size, [1] * batch_size, hkv * group, d, ps, pages, torch.bfloat16, gen, DEV)
    kg, vg = scales(gen)
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


@pytest.mark.parametrize("seed", range(48))
def test_fuzz_fixed_seeds(seed):
    """A fixed-seed subset of ``nvfp4-backend fuzz`` (the 1000-configuration runs are in results/)."""
    rec = fuzz.run_config(fuzz.generate(seed, max_context=32768), torch.device(DEV))
    assert rec["ok"], f"{rec['summary']}: {rec['failure']} (replay: nvfp4-backend fuzz --replay {seed} --max-context 32768)"


def test_binding_rejects_bad_arguments(gen):
    """The binding's own checks, behind the Python ops': too many splits, a misaligned split
    workspace, too many rows, a float32 or CPU query, kv heads per block that are not 1, 2, 4 or
    whose rows do not fit, a bad scale rule are RuntimeErrors naming the argument (not a crash), and
    nothing is written."""
    cache = make_cache("HND", 64, 16, 2, 128, DEV)
    fill_random(cache, gen)
    batch = make_batch([300, 40], [1, 1], 8, 128, 16, 64, torch.bfloat16, gen, DEV)
    kg, vg = scales(gen)
    kernels = jit.load(torch.device(DEV))
    workspace = torch.empty(2 * 2 * (capabilities.MAX_SPLITS + 1) * 4 * 130 * 4 + 16, dtype=torch.uint8, device=DEV)
    # the messages that format numbers, dtypes and devices matter most: see text() in csrc/binding.cpp
    q32 = batch.q.float()
    cases = [  # (q, num_splits, workspace, max_query_len, heads_per_block, message)
        (batch.q, capabilities.MAX_SPLITS + 1, workspace, 1, 1,
         rf"num_splits must lie in \[1, {capabilities.MAX_SPLITS}\], got {capabilities.MAX_SPLITS + 1}"),
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


def test_flashinfer_cross_check(gen):
    flashinfer = pytest.importorskip("flashinfer")
    B, L, ps, hkv, group, D = 4, 777, 16, 2, 4, 128
    cache = make_cache("NHD", B * math.ceil(L / ps) + 1, ps, hkv, D, DEV)
    fill_random(cache, gen)
    batch = make_batch([L] * B, [1] * B, hkv * group, D, ps, cache.num_pages, torch.bfloat16, gen, DEV)
    kg, vg = scales(gen)
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
