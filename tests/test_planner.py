"""The split-KV and heads-per-block planner (``planner.plan_attention``): splits, packed kv heads,
the fused kernel's choice, and the plans it rejects."""
from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from nvfp4_backend import capabilities, planner


@pytest.mark.parametrize("batch, kv_heads, group, q_len, seq_len, head_dim", [
    (64, 8, 4, 1, 4096, 128), (1, 1, 8, 2, 4096, 128), (3, 2, 16, 4, 300, 64), (1, 1, 1, 1, 100, 256),
    (2, 4, 4, 8, 70000, 256)])
def test_plan_attention_workspace_holds_the_partials(batch, kv_heads, group, q_len, seq_len, head_dim):
    """Whatever the split heuristic, every split gets at least SPLIT_MIN_TOKENS keys (so one split
    for short sequences), and the workspace holds fp32 [rows, D] partials plus max and sum per row."""
    plan = planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim)
    assert 1 <= plan.num_splits <= max(1, math.ceil(seq_len / planner.SPLIT_MIN_TOKENS))
    if plan.num_splits == 1:
        assert plan.workspace_bytes == 0
    else:
        assert plan.workspace_bytes >= batch * kv_heads * plan.num_splits * q_len * group * (head_dim + 2) * 4
    assert plan.allocate_workspace("cpu").numel() >= plan.workspace_bytes
    more = planner.plan_attention(batch * 64, kv_heads, group, q_len, seq_len, head_dim)
    assert more.num_splits <= plan.num_splits                   # a fuller grid never needs more splits


@pytest.mark.parametrize("batch", [1, 7, 40, 64, 96, 128, 192, 256, 1000])
@pytest.mark.parametrize("kv_heads, group, q_len", [(8, 4, 1), (8, 2, 1), (5, 1, 1), (8, 4, 2), (8, 8, 1), (3, 3, 1)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_plan_attention_packs_kv_heads_only_where_it_saves_waves(batch, kv_heads, group, q_len, head_dim):
    """Several kv heads per block only for plain decode whose rows fit, never together with split-KV
    (packing is for grids past one wave, splits for grids short of one), and only where the packed
    grid's waves, each as many times longer as heads are packed, add up to no more than before.  A
    wave is as many blocks as the kernel keeps resident: 4 per SM at D 128, 2 at D 256."""
    plan = planner.plan_attention(batch, kv_heads, group, q_len, 512, head_dim, num_sms=132)
    hb = plan.heads_per_block
    assert capabilities.heads_per_block_allowed(group, q_len, hb)
    slots = {128: 4, 256: 2}[head_dim] * 132
    cost = lambda h: math.ceil(batch * -(-kv_heads // h) / slots) * h  # noqa: E731
    if hb > 1:
        assert plan.num_splits == 1
        assert cost(hb) <= cost(1)
    if batch * kv_heads <= slots:
        assert hb == 1  # one wave already: packing would only make the blocks longer
    else:  # past one wave, more heads per block wherever they do not add waves (a tie saves starts and ends)
        for more in (2, 4):
            if more > hb and capabilities.heads_per_block_allowed(group, q_len, more):
                assert cost(more) > cost(hb)


@pytest.mark.parametrize("batch, seq_len", [(1, 131072), (8, 32768), (32, 8192), (16, 16384), (64, 8192),
                                            (128, 512), (256, 2048), (3, 100)])
@pytest.mark.parametrize("kv_heads, group, head_dim", [(8, 4, 128), (8, 2, 64), (8, 8, 128), (8, 4, 256), (1, 4, 128)])
def test_plan_attention_packs_token_major_split_grids(batch, seq_len, kv_heads, group, head_dim):
    """A token-major cache packs 2 kv heads per block wherever the head-major plan splits with one
    head per block and 2 fit (D <= 128, more than one kv head); elsewhere both plans are the same.
    Fused plans likewise: 2 kv heads per block at least where one head per block would split."""
    fused = planner.plan_attention(batch, kv_heads, group, 1, seq_len, head_dim, token_major=True)
    fused_head_major = planner.plan_attention(batch, kv_heads, group, 1, seq_len, head_dim)
    if fused.fused and kv_heads > 1 and fused_head_major.fused and fused_head_major.heads_per_block == 1:
        assert fused.heads_per_block == (2 if fused_head_major.num_splits > 1 else 1)
    elif fused.fused or fused_head_major.fused:
        assert fused == fused_head_major
    head_major = planner.plan_attention(batch, kv_heads, group, 1, seq_len, head_dim, fused=False)
    token_major = planner.plan_attention(batch, kv_heads, group, 1, seq_len, head_dim, token_major=True, fused=False)
    packs = (head_major.num_splits > 1 and head_major.heads_per_block == 1 and kv_heads > 1 and head_dim <= 128
             and capabilities.heads_per_block_allowed(group, 1, 2))
    if packs:
        assert token_major.heads_per_block == 2
        assert token_major == planner.plan_attention(batch, kv_heads, group, 1, seq_len, head_dim, heads_per_block=2)
        assert not token_major.fused
    else:
        assert token_major == head_major


@pytest.mark.parametrize("batch, kv_heads, group, q_len, seq_len, head_dim, token_major, want", [
    (64, 8, 4, 1, 8192, 128, False, (4, 1)),      # 128 blocks of 4 kv heads on 132 SMs
    (64, 8, 4, 4, 8192, 128, False, (4, 1)),      # 16 rows: two row tiles, up to 4 heads
    (32, 8, 4, 1, 8192, 128, False, (2, 1)),
    (1, 8, 4, 1, 131072, 128, False, (1, 16)),    # 8 blocks per split
    (1, 8, 4, 1, 131072, 128, True, (2, 33)),     # token-major: 2 heads per block where 1 would split
    (16, 8, 4, 1, 16384, 128, True, (1, 1)),      # ... and 1 where it would not
    (16, 8, 4, 1, 16384, 128, False, (1, 1)),
    (32, 8, 4, 4, 8192, 128, False, (2, 1)),
    (1, 8, 4, 4, 131072, 128, False, None),       # two row tiles only unsplit
    (8, 8, 2, 1, 32768, 64, False, (1, 2)),
    (256, 8, 4, 1, 2048, 128, False, None),       # 256 blocks at 8 heads: past one per SM
    (128, 8, 4, 1, 512, 128, False, None),        # 512 tokens: short of FUSED_MIN_TOKENS
    (100, 8, 4, 1, 8192, 128, False, None),       # 100 blocks fill 76 % of the SMs
    (64, 8, 4, 1, 8192, 256, False, None),        # D 256: no fused kernel
    (64, 8, 4, 8, 8192, 128, False, None),        # 32 rows
    (0, 8, 4, 1, 8192, 128, False, None)])
def test_plan_attention_picks_the_fused_kernel(batch, kv_heads, group, q_len, seq_len, head_dim, token_major, want):
    """The fused kernel for grids of about one block per SM (at least FUSED_MIN_FILL of them) with long
    enough ranges: the fewest kv heads per block that fit, splits for the rest of the SMs."""
    plan = planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim, num_sms=132, token_major=token_major)
    if want is None:
        assert not plan.fused
        return
    assert plan.fused and (plan.heads_per_block, plan.num_splits) == want
    blocks = batch * -(-kv_heads // plan.heads_per_block) * plan.num_splits
    assert planner.FUSED_MIN_FILL * 132 <= blocks <= 132
    assert seq_len >= plan.num_splits * planner.FUSED_MIN_TOKENS
    assert plan.workspace_bytes == (batch * kv_heads * plan.num_splits * q_len * group * (head_dim + 2) * 4
                                    if plan.num_splits > 1 else 0)
    # what a caller asks for wins: fused off, or a static heads per block
    assert not planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim, fused=False).fused
    assert not planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim, heads_per_block=1).fused


@pytest.mark.parametrize("limit, fits", [(101376, False), (166912, True), (232448, True), (None, True)])
def test_plan_attention_picks_the_fused_kernel_only_where_the_device_gives_its_shared_memory(limit, fits, monkeypatch):
    """sm_86 / sm_89 / sm_120 give a block 99 KB (101376 bytes), sm_80 163 KB, sm_90 227 KB; a torch
    without the property: assume it fits (the launcher falls back to the static kernel)."""
    props = types.SimpleNamespace(multi_processor_count=132)
    if limit is not None:
        props.shared_memory_per_block_optin = limit
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert capabilities.fused_fits("cuda:0") == fits
    assert capabilities.fused_fits("cpu")  # off CUDA a plan is bookkeeping
    plan = planner.plan_attention(64, 8, 4, 1, 8192, 128, 132, device="cuda:0")
    assert plan.fused == fits and plan == planner.plan_attention(64, 8, 4, 1, 8192, 128, 132, fused=None if fits else False)
    # asked for, it is planned anyway (the launcher runs it where it fits)
    assert planner.plan_attention(64, 8, 4, 1, 8192, 128, 132, fused=True, heads_per_block=4, device="cuda:0").fused


def test_plan_attention_rejects_a_fused_kernel_that_does_not_fit():
    with pytest.raises(ValueError, match="fused needs head_dim 64 or 128 and max_query_len x group_size <= 16"):
        planner.plan_attention(64, 8, 4, 1, 8192, 256, fused=True)
    with pytest.raises(ValueError, match="heads_per_block 8 does not fit the fused kernel.*max_query_len 4"):
        planner.plan_attention(64, 8, 4, 4, 8192, 128, heads_per_block=8, fused=True)
    assert planner.plan_attention(64, 8, 4, 1, 8192, 128, heads_per_block=8, fused=True).heads_per_block == 8


@pytest.mark.parametrize("q_len, head_dim, per_sm", [(1, 128, 4), (2, 128, 4), (3, 128, 3), (4, 64, 4), (4, 128, 3),
                                                     (8, 128, 2), (2, 256, 2), (4, 256, 2)])
def test_plan_attention_split_target_per_kernel(q_len, head_dim, per_sm):
    """Splits fill per_sm blocks per SM, what each kernel keeps resident: 4 for the kernels of one row
    tile and of two at D 64, 3 for two row tiles at D 128 (that kernel's launch bound), 2 for 32 rows
    and at D 256 (shared memory) (8 requests x 8 kv heads: 64 blocks per split, so 132 SMs take
    per_sm * 132 // 64 splits)."""
    plan = planner.plan_attention(8, 8, 4, q_len, 65536, head_dim, num_sms=132, heads_per_block=1)
    assert plan.num_splits == per_sm * 132 // 64


@pytest.mark.parametrize("num_sms", [0, -1, 1.5])
def test_plan_attention_rejects_a_bad_sm_count(num_sms):
    with pytest.raises(ValueError, match=f"num_sms must be a positive int, got {num_sms!r}"):
        planner.plan_attention(256, 8, 4, 1, 512, 128, num_sms=num_sms)


@pytest.mark.parametrize("group, q_len, heads_per_block", [(4, 1, 4), (2, 2, 2), (1, 1, 3), (8, 1, 2), (4, 1, 0)])
def test_plan_attention_rejects_heads_per_block_that_do_not_fit(group, q_len, heads_per_block):
    """Several kv heads per block only for plain decode whose packed rows fit one row tile (8)."""
    with pytest.raises(ValueError, match=f"heads_per_block must be 1, or 2 or 4 .* got {heads_per_block}"):
        planner.plan_attention(64, 8, group, q_len, 4096, 128, heads_per_block=heads_per_block)


@pytest.mark.parametrize("group_size, head_dim", [(1, 64), (4, 128), (8, 128), (16, 64), (4, 256), (64, 128)])
def test_plan_covers_the_decode_share_of_a_long_call(group_size, head_dim):
    """A call whose queries exceed the decode kernel's rows is planned as its decode share: the
    requests of up to decode_query_len tokens (the prefill kernel needs no plan)."""
    share = capabilities.decode_query_len(group_size, head_dim)
    assert share * group_size <= capabilities.decode_max_rows(head_dim) < (share + 1) * group_size
    for max_query_len in (share + 1, 4096):
        got = planner.plan_attention(8, 8, group_size, max_query_len, 20000, head_dim)
        assert got == planner.plan_attention(8, 8, group_size, share, 20000, head_dim)


def test_plan_from_query_lens_sizes_the_decode_share():
    """With the step's query lengths, the decode kernel is planned for its own requests only: a mixed
    batch of decodes and long chunks plans as the decodes alone; no short request, no decode launch."""
    mixed = planner.plan_attention(65, 8, 4, 2048, 14336, 128, query_lens=[1] * 64 + [2048])
    assert mixed.decode_query_len == 1
    assert dataclasses.replace(mixed, decode_query_len=None) == planner.plan_attention(65, 8, 4, 1, 14336, 128)
    assert planner.plan_attention(2, 8, 4, 2048, 14336, 128, query_lens=[2048, 700]).decode_query_len == 0
    assert planner.plan_attention(3, 8, 4, 2048, 14336, 128, query_lens=[3, 16, 17]).decode_query_len == 16


@pytest.mark.parametrize("batch, kv_heads, group, q_len, head_dim", [(32, 8, 8, 1, 64), (1, 4, 7, 1, 128), (64, 8, 4, 4, 128),
                                                                     (8, 8, 2, 1, 256)])
@pytest.mark.parametrize("window", [1, 128, 4096, 1 << 20])
def test_plan_for_a_window_is_the_plan_for_the_tokens_it_reads(batch, kv_heads, group, q_len, head_dim, window):
    """A windowed layer's rows read at most window + q_len - 1 positions, whatever the request's
    length: it is planned as a request of that length (fewer splits, and no fused kernel for short
    ranges), and a window wider than the sequence changes nothing."""
    seq_len = 8192
    got = planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim, sliding_window=window)
    read = min(seq_len, window + q_len - 1)
    assert planner.kv_tokens_read(seq_len, q_len, window) == read
    assert got == planner.plan_attention(batch, kv_heads, group, q_len, read, head_dim)
    assert got.num_splits <= max(1, math.ceil(read / planner.SPLIT_MIN_TOKENS))  # no split shorter than the minimum
    assert not (got.fused and read < got.num_splits * planner.FUSED_MIN_TOKENS)
    assert got.num_splits <= planner.plan_attention(batch, kv_heads, group, q_len, seq_len, head_dim).num_splits
    if read <= planner.SPLIT_MIN_TOKENS:
        assert got.num_splits == 1 and not got.fused


def test_plan_for_gpt_oss_windowed_decodes_runs_one_static_split():
    """gpt-oss's windowed layers (64 q / 8 kv heads, D 64, window 128): 32 decodes at 8K read 128
    positions each, which the static kernel serves unsplit; unwindowed, the same step plans the
    fused kernel over 8192 positions."""
    full = planner.plan_attention(32, 8, 8, 1, 8192, 64, 132)
    windowed = planner.plan_attention(32, 8, 8, 1, 8192, 64, 132, sliding_window=128)
    assert full.fused
    assert (windowed.num_splits, windowed.fused, windowed.workspace_bytes) == (1, False, 0)


@pytest.mark.parametrize("window, error", [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError),
                                           ("128", TypeError)])
def test_plan_rejects_a_bad_sliding_window(window, error):
    """As ops.paged_attention rejects it: TypeError for what is not an int, ValueError for <= 0."""
    with pytest.raises(error, match="sliding_window must be"):
        planner.plan_attention(8, 8, 4, 1, 4096, 128, sliding_window=window)
