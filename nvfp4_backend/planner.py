"""The split-KV and heads-per-block planner of the decode op.

A plan is made on the host, once per step and outside CUDA graphs (the plugins' metadata builders
call ``plan_attention``): how many KV splits each (request, kv head) gets so the grid fills the GPU,
the workspace the splits need, how many kv heads one thread block serves, and whether the fused
kernel runs.  It reads host-known bounds only, so a captured graph stays valid for any sequence
lengths up to the ones it was planned for.  What the kernels serve at all is ``capabilities``'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .dense_prefill import DensePrefillPlan
from .capabilities import DECODE_BLOCKS_PER_SM, ROW_TILE, decode_blocks_per_sm, decode_query_len as decode_query_limit, \
    fused_allowed, fused_fits, heads_per_block_allowed


@dataclass(frozen=True)
class AttentionPlan:
    """Host-side decisions for one step, made once (outside CUDA graphs) by the metadata builder:
    the split-KV count, the workspace the splits need, how many kv heads one thread block serves
    and whether the fused kernel runs (``fused_allowed``: one block of 12 or 16 warps per
    ``heads_per_block`` kv heads, where the GPU gives a block the shared memory; elsewhere the
    same plan runs one kv head per block).  ``decode_query_len``: the longest query the decode kernel
    serves (the requests of up to that many tokens; longer ones go to the prefill kernel; 0: the
    decode kernel is not launched); None: every request it can hold (``capabilities.decode_query_len``).
    ``prefill``: the longer requests' dense prefill (``dense_prefill.DensePrefill.plan``); None: the
    prefill kernel serves them."""
    num_splits: int
    workspace_bytes: int
    heads_per_block: int = 1
    fused: bool = False
    decode_query_len: int | None = None
    prefill: "DensePrefillPlan | None" = None

    def allocate_workspace(self, device) -> torch.Tensor:
        return torch.empty(max(self.workspace_bytes, 16), dtype=torch.uint8, device=device)


SPLIT_MIN_TOKENS = 256
"""Shortest KV range worth a thread block of its own."""
_ONE_ROW_TILE_BLOCKS_PER_SM = DECODE_BLOCKS_PER_SM[128][0]
SPLIT_BLOCKS_PER_SM = _ONE_ROW_TILE_BLOCKS_PER_SM
"""Thread blocks per SM the split count aims for with up to 8 query rows per block (the kernel of
one row tile, D <= 128).  The count is rounded down: the splits never spill a partial extra wave past
that many blocks per SM.  Kernels that keep fewer blocks resident (more registers, or D 256's shared
memory) get less: blocks_per_sm.  An experiment may set another (``bench --blocks-per-sm``): every
kernel's count scales with it."""


def blocks_per_sm(rows: int, head_dim: int) -> int:
    """Blocks per SM of the static kernel for ``rows`` query rows, what it keeps resident: the split
    planner's target and the heads-per-block picker's wave (``capabilities.DECODE_BLOCKS_PER_SM``,
    scaled where SPLIT_BLOCKS_PER_SM was set).  At D <= 128, 4 for one row tile and for two at D 64
    (their launch bound); 3 for two row tiles at D 128, whose kernel takes two stages per iteration in
    some 160 registers (bound 3); 2 for 17-64 rows (the kernels of four row tiles, whose registers keep
    2 on every GPU and whose shared memory does on sm_90 and sm_100; D 64's 33-64 rows run four row
    warps of two, bound by the compiler), and for D 256, whose shared memory keeps 2.  Planning for
    more blocks than stay resident leaves a partial wave (the measurements: docs/decisions.md, planner)."""
    return max(1, decode_blocks_per_sm(rows, head_dim) * SPLIT_BLOCKS_PER_SM // _ONE_ROW_TILE_BLOCKS_PER_SM)


def num_sms(device) -> int:
    """SMs the split planner fills: the device's count on CUDA; off CUDA (the reference path, where
    the plan is only bookkeeping) an H100/H200's 132."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _thread_blocks(batch_size: int, num_kv_heads: int, heads_per_block: int) -> int:
    """Decode thread blocks per split: each request's kv heads, heads_per_block to a block (the
    kernel's grid; the last block of a request may hold fewer)."""
    return batch_size * -(-num_kv_heads // heads_per_block)


def _splits_to_fill(blocks: int, slots: int, max_seq_len: int) -> int:
    """Splits of each request's KV range so that ``blocks`` thread blocks per split fill ``slots``
    (rounded down), none shorter than SPLIT_MIN_TOKENS."""
    return max(1, min(slots // max(blocks, 1), math.ceil(max_seq_len / SPLIT_MIN_TOKENS)))


def _pick_heads_per_block(batch_size: int, num_kv_heads: int, group_size: int, max_query_len: int,
                          slots: int) -> int:
    """Kv heads per thread block, for a wave of ``slots`` blocks (the kernel's residency,
    blocks_per_sm, times the SMs).  Packing h heads makes 1/h as many blocks, each h times as long,
    so it pays when the blocks take fewer waves by a factor of h or more; at a tie it saves each
    block's start and end, which won in most of the ties measured (the losses were at longer
    sequences, which the picker does not weigh: docs/decisions.md, planner)."""
    unpacked = _thread_blocks(batch_size, num_kv_heads, 1)
    if unpacked <= slots:
        return 1  # one wave already (an empty batch too): packing would only make the blocks longer
    best, best_cost = 1, math.ceil(unpacked / slots)
    for heads_per_block in (2, 4):
        if heads_per_block_allowed(group_size, max_query_len, heads_per_block):
            cost = math.ceil(_thread_blocks(batch_size, num_kv_heads, heads_per_block) / slots) * heads_per_block
            if cost <= best_cost:
                best, best_cost = heads_per_block, cost
    return best


FUSED_MIN_TOKENS = 1024
"""Shortest KV range per kv head and split that the planner gives the fused kernel: its blocks'
start and end cost more than the static kernels', so short ranges stay on those (docs/decisions.md,
planner)."""
FUSED_MIN_FILL = 0.9
"""Least share of the SMs the fused kernel's one-block-per-SM grid must fill for the planner to pick it."""


def _plan_fused(batch_size: int, num_kv_heads: int, group_size: int, max_query_len: int, max_seq_len: int,
                head_dim: int, num_sms: int, token_major: bool) -> tuple[int, int] | None:
    """(kv heads per block, splits) for the fused kernel, or None where the static kernels are the
    better choice.  The fused kernel runs one block per SM whose warps stream the same tokens
    whole-call long, where the static kernels' four blocks per SM end one after another and a grid
    may leave a partial wave (4 query tokens at 64 x 8192: 512 blocks of 3 per SM).  It takes the
    fewest heads per block whose grid fits one block per SM, and splits to fill the rest.  In a
    token-major cache, whose adjacent kv heads share 128-byte lines, two heads at least where one head
    per block would split, as the static planner packs (plan_attention); unsplit grids keep one
    head per block (docs/decisions.md, planner)."""
    if batch_size == 0:
        return None
    pack = (token_major and num_kv_heads > 1
            and _splits_to_fill(_thread_blocks(batch_size, num_kv_heads, 1), num_sms, max_seq_len) > 1)
    for heads_per_block in (2, 4, 8) if pack else (1, 2, 4, 8):
        if not fused_allowed(head_dim, group_size, max_query_len, heads_per_block):
            return None
        blocks = _thread_blocks(batch_size, num_kv_heads, heads_per_block)
        if blocks <= num_sms:
            break
    else:
        return None
    splits = _splits_to_fill(blocks, num_sms, max_seq_len)
    if blocks * splits < FUSED_MIN_FILL * num_sms or max_seq_len < splits * FUSED_MIN_TOKENS:
        return None
    if splits > 1 and max_query_len * group_size > ROW_TILE:
        return None  # two row tiles split: no faster than the static kernels (docs/decisions.md, planner)
    return heads_per_block, splits


def check_sliding_window(sliding_window) -> None:
    """A TypeError unless ``sliding_window`` is an int or None, a ValueError unless it is positive."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")


def kv_tokens_read(max_seq_len: int, max_query_len: int, sliding_window: int | None) -> int:
    """The most cache positions one request's rows read: the first row sees ``sliding_window``
    positions and each later row one more (the decode kernel's range: csrc/decode_kernel.cuh)."""
    check_sliding_window(sliding_window)
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + max(max_query_len, 1) - 1)


def check_heads_per_block(name: str, group_size: int, max_query_len: int, heads_per_block: int, head_dim: int,
                          fused: bool) -> None:
    """Raises a ValueError naming ``name`` unless the kernel asked for (``fused`` or the static ones)
    serves ``heads_per_block`` kv heads per block at these rows."""
    if fused:
        if not fused_allowed(head_dim, group_size, max_query_len, heads_per_block):
            raise ValueError(f"{name} {heads_per_block} does not fit the fused kernel: it needs head_dim 64 or 128 "
                             f"and max_query_len x group_size <= 16 with up to 8 kv heads per block at <= 8 rows and "
                             f"4 at <= 16 (head_dim {head_dim}, max_query_len {max_query_len}, group_size {group_size})")
        return
    if not heads_per_block_allowed(group_size, max_query_len, heads_per_block):
        raise ValueError(f"{name} must be 1, or 2 or 4 with max_query_len 1 and heads_per_block x group_size <= 8; "
                         f"got {heads_per_block} (max_query_len {max_query_len}, group_size {group_size})")


def plan_attention(batch_size: int, num_kv_heads: int, group_size: int, max_query_len: int,
                   max_seq_len: int, head_dim: int, num_sms: int = 132,
                   heads_per_block: int | None = None, token_major: bool = False,
                   fused: bool | None = None, device=None, query_lens=None,
                   sliding_window: int | None = None) -> AttentionPlan:
    """Choose the split-KV count so batch x kv_heads x splits fills the GPU, and size the workspace.

    The split count is a function of host-known bounds only, so a captured graph stays valid for
    any sequence lengths up to the ones it was planned for (longer ones just get longer splits).
    ``heads_per_block``: kv heads per thread block (1, 2 or 4; up to 8 with ``fused``); None picks it.
    ``fused``: run the fused kernel (``fused_allowed``); None lets the planner choose
    (``_plan_fused``; only when ``heads_per_block`` is None too, and, given ``device``, where
    ``fused_fits(device)``).
    The plan is the decode kernel's (its share of the call: requests of up to
    ``capabilities.decode_query_len`` tokens; the prefill kernel needs none).  ``query_lens``: the
    step's query lengths on the host, where the caller has them (a mixed batch): the decode kernel is
    then planned for its own requests' longest query (``AttentionPlan.decode_query_len``), and not
    launched when there are none.
    ``token_major``: the cache keeps a token's kv heads side by side (``PagedKVCache.token_major``:
    NHD pages, SGLang's token rows; ``paged_attention``'s own plan and both plugins pass it).  A grid that would split then packs 2 kv heads per block where
    they fit: at D <= 128 both heads' rows of a token lie in one 128-byte line, which one block then
    reads at once (head-major pages lose by packing there: docs/decisions.md, planner).
    ``sliding_window``: the window of the layers the plan serves (None: full attention).  A request's
    rows then read at most ``kv_tokens_read`` positions, whatever its length, and the splits and the
    fused kernel's choice are planned for those (the kernel divides the windowed range among the
    splits).  Any plan is correct for any layer; a layer with a wider window than its plan's gets
    fewer, longer splits than its own plan would give it.
    """
    if not (isinstance(num_sms, int) and num_sms > 0):
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    limit = decode_query_limit(group_size, head_dim)
    decode_query_len = None
    if query_lens is not None:
        decode_query_len = max((int(n) for n in query_lens if 0 < int(n) <= limit), default=0)
        max_query_len = decode_query_len
    max_query_len = min(max_query_len, limit)
    max_seq_len = kv_tokens_read(max_seq_len, max_query_len, sliding_window)
    if max_query_len < 1:
        return AttentionPlan(1, 0, decode_query_len=decode_query_len)
    if heads_per_block is not None:
        check_heads_per_block("heads_per_block", group_size, max_query_len, heads_per_block, head_dim, bool(fused))
    if fused and not fused_allowed(head_dim, group_size, max_query_len, heads_per_block or 1):
        raise ValueError(f"fused needs head_dim 64 or 128 and max_query_len x group_size <= 16, got head_dim "
                         f"{head_dim}, max_query_len {max_query_len}, group_size {group_size}")
    rows = max_query_len * group_size

    def plan(splits: int, heads_per_block: int, fused: bool = False) -> AttentionPlan:
        # per split and kv head: fp32 partial output [rows, D] plus running max and sum per row
        workspace = batch_size * num_kv_heads * splits * rows * (head_dim + 2) * 4 if splits > 1 else 0
        return AttentionPlan(splits, workspace, heads_per_block, fused, decode_query_len)

    choice = None
    if fused is None and heads_per_block is None and (device is None or fused_fits(device)):
        choice = _plan_fused(batch_size, num_kv_heads, group_size, max_query_len, max_seq_len, head_dim, num_sms,
                             token_major)
    elif fused:  # asked for: the given heads per block (or one), splits to fill one block per SM
        fused_heads = heads_per_block or 1
        choice = fused_heads, _splits_to_fill(_thread_blocks(batch_size, num_kv_heads, fused_heads), num_sms, max_seq_len)
    if choice is not None:
        fused_heads, splits = choice
        return plan(splits, fused_heads, fused=True)
    slots = blocks_per_sm(rows, head_dim) * num_sms  # one wave of blocks

    def splits_for(heads_per_block: int) -> int:
        return _splits_to_fill(_thread_blocks(batch_size, num_kv_heads, heads_per_block), slots, max_seq_len)

    if heads_per_block is None:
        heads_per_block = _pick_heads_per_block(batch_size, num_kv_heads, group_size, max_query_len, slots)
        if (token_major and heads_per_block == 1 and num_kv_heads > 1 and head_dim <= 128
                and heads_per_block_allowed(group_size, max_query_len, 2) and splits_for(1) > 1):
            heads_per_block = 2
    return plan(splits_for(heads_per_block), heads_per_block)
