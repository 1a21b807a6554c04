"""Public ops: quantize-on-write and paged attention over an NVFP4 cache.

Each is a ``torch.library`` custom op (``torch.ops.nvfp4_backend.*``) with a fake implementation,
so it traces under ``torch.compile`` and captures in CUDA graphs.  On CUDA tensors the op runs the
JIT-built kernels (``nvfp4_backend.jit``); elsewhere, or where the kernels cannot serve a shape,
it runs the reference.  The Python wrappers validate every argument first, so bad input raises
a ``ValueError``/``TypeError`` naming the argument and nothing is written.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import format as fmt
from . import reference
from .layout import PagedKVCache

_lib = torch.library.Library("nvfp4_backend", "DEF")
_lib.define(
    "write_kv(Tensor key, Tensor value, Tensor slot_mapping, Tensor(a!) k_data, Tensor(b!) k_block_scales, "
    "Tensor(c!) v_data, Tensor(d!) v_block_scales, Tensor k_global_scale, Tensor v_global_scale, "
    "str scale_rule=\"6\", str rotation=\"none\") -> ()")
_lib.define(
    "paged_attention(Tensor(a!) out, Tensor q, Tensor k_data, Tensor k_block_scales, Tensor v_data, "
    "Tensor v_block_scales, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
    "Tensor k_global_scale, Tensor v_global_scale, float softmax_scale, int sliding_window, "
    "float logits_soft_cap, Tensor? sinks, int max_query_len, int num_splits, Tensor(b!) workspace, "
    "str rotation=\"none\", int heads_per_block=1, bool fused=False, int decode_query_len=-1) -> ()")

QUERY_DTYPES = (torch.float16, torch.bfloat16)


# ============================================================================ validation
def _check_tensor(name: str, t, dtypes, dim: int | None = None, device: torch.device | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the cache's device)")


def _check_rows_aligned(name: str, t: torch.Tensor) -> None:
    """The decode kernel reads query rows and writes output rows in 16-byte pieces."""
    misaligned = [f"stride({i})" for i in range(t.dim() - 1) if t.shape[i] > 1 and t.stride(i) * t.element_size() % 16]
    if t.data_ptr() % 16:
        misaligned.insert(0, "data pointer")
    if misaligned:
        raise ValueError(f"{name} rows must be 16-byte aligned (data pointer and token / head strides multiples of 16 "
                         f"bytes), got {', '.join(misaligned)} off (strides {t.stride()}, storage offset "
                         f"{t.storage_offset()})")


def _host_checks() -> bool:
    """Value checks that read tensor contents run eagerly only: under torch.compile they would be
    data-dependent, and on a GPU they would synchronize (and break CUDA-graph capture)."""
    return not torch.compiler.is_compiling()


def _check_global_scale(name: str, t, device: torch.device) -> torch.Tensor:
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"{name} must be a positive finite number, got {t}")
        return torch.tensor(float(t), dtype=torch.float32, device=device)
    _check_tensor(name, t, (torch.float32,), device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold one fp32 value, got shape {tuple(t.shape)}")
    if device.type == "cpu" and _host_checks() and not (float(t) > 0 and math.isfinite(float(t))):
        raise ValueError(f"{name} must be positive and finite, got {float(t)}")
    return t.reshape(())


def _check_cache(cache) -> PagedKVCache:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    cache.validate()
    return cache


# ============================================================================ write
def write_kv(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKVCache,
             k_global_scale, v_global_scale) -> None:
    """Quantize ``key``/``value`` [tokens, kv_heads, D] (fp16/bf16) into ``slot_mapping``'s slots.

    Slot s is token s % page_size of page s // page_size; negative slots are skipped (padding).
    """
    cache = _check_cache(cache)
    dev = cache.device
    _check_tensor("key", key, QUERY_DTYPES, 3, dev)
    _check_tensor("value", value, (key.dtype,), 3, dev)
    want = (key.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [tokens, kv_heads, head_dim] = {want}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    _check_tensor("slot_mapping", slot_mapping, (torch.int64, torch.int32), 1, dev)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if dev.type == "cpu" and _host_checks() and slot_mapping.numel() and int(slot_mapping.max()) >= cache.num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slot_mapping.max())} but the cache has {cache.num_slots} slots")
    kg = _check_global_scale("k_global_scale", k_global_scale, dev)
    vg = _check_global_scale("v_global_scale", v_global_scale, dev)
    torch.ops.nvfp4_backend.write_kv(key, value, slot_mapping, *cache.tensors(), kg, vg, cache.mode.scale_rule,
                                     cache.mode.rotation)


@functools.lru_cache(maxsize=None)
def _hadamard_on(head_dim: int, device: torch.device) -> torch.Tensor:
    # built and copied to the device once, not on every write and attention call
    return fmt.hadamard(head_dim, device)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """x H along the head dim (H orthonormal, symmetric, its own inverse), in fp32, back to x's dtype."""
    return (x.float() @ _hadamard_on(x.shape[-1], x.device)).to(x.dtype)


def _write_kv_impl(key, value, slot_mapping, k_data, k_block_scales, v_data, v_block_scales,
                   k_global_scale, v_global_scale, scale_rule="6", rotation="none") -> None:
    from . import jit
    # head dims the kernels were tested with on a GPU; any other multiple of 16 takes the reference
    if (key.is_cuda and key.shape[-1] in fmt.SUPPORTED_HEAD_DIMS
            and jit.kernels_available(key.device)):
        if key.stride() != value.stride() or any(st % 8 for st in key.stride()[:2]):
            # the kernel reads K and V with one set of 16-byte-aligned strides (torch calls a tensor
            # contiguous whatever the stride of a size-1 dim, so copy into fresh standard strides)
            key = torch.empty(key.shape, dtype=key.dtype, device=key.device).copy_(key)
            value = torch.empty(value.shape, dtype=value.dtype, device=value.device).copy_(value)
        jit.load(key.device).write_kv(key, value, slot_mapping.long(), k_data, k_block_scales, v_data,
                                      v_block_scales, k_global_scale, v_global_scale, scale_rule, rotation)
        return
    if rotation == "hadamard":  # the writer's rotation, fmt.hadamard_transform, rounded to the input dtype
        key = fmt.hadamard_transform(key).to(key.dtype)
        value = fmt.hadamard_transform(value).to(value.dtype)
    cache = PagedKVCache(k_data, k_block_scales, v_data, v_block_scales)
    reference.write_kv_ref(key, value, slot_mapping, cache, k_global_scale, v_global_scale, scale_rule)


_lib.impl("write_kv", _write_kv_impl, "CPU")
_lib.impl("write_kv", _write_kv_impl, "CUDA")


@torch.library.register_fake("nvfp4_backend::write_kv")
def _write_kv_fake(key, value, slot_mapping, k_data, k_block_scales, v_data, v_block_scales,
                   k_global_scale, v_global_scale, scale_rule="6", rotation="none") -> None:
    return None


# ============================================================================ attention
@dataclass(frozen=True)
class AttentionPlan:
    """Host-side decisions for one step, made once (outside CUDA graphs) by the metadata builder:
    the split-KV count, the workspace the splits need, how many kv heads one thread block serves
    and whether the fused kernel runs (``fused_allowed``: one block of 12 or 16 warps per
    ``heads_per_block`` kv heads, where the GPU gives a block the shared memory; elsewhere the
    same plan runs one kv head per block).  ``decode_query_len``: the longest query the decode kernel
    serves (the requests of up to that many tokens; longer ones go to the prefill kernel; 0: the
    decode kernel is not launched); None: every request it can hold (``jit.decode_query_len``)."""
    num_splits: int
    workspace_bytes: int
    heads_per_block: int = 1
    fused: bool = False
    decode_query_len: int | None = None

    def allocate_workspace(self, device) -> torch.Tensor:
        return torch.empty(max(self.workspace_bytes, 16), dtype=torch.uint8, device=device)


MAX_SPLITS = 8192
"""Most KV splits the decode op accepts (csrc/nvfp4_kernels.h kMaxSplits)."""
SPLIT_MIN_TOKENS = 256
"""Shortest KV range worth a thread block of its own."""
SPLIT_BLOCKS_PER_SM = 4
"""Thread blocks per SM the split count aims for with up to 8 query rows per block (the kernel of
one row tile, D <= 128).  The count is rounded down: the splits never spill a partial extra wave past
that many blocks per SM.  Kernels that keep fewer blocks resident (more registers, or D 256's shared
memory) get less: _blocks_per_sm."""


def _blocks_per_sm(rows: int, head_dim: int) -> int:
    """Blocks per SM of the kernel for ``rows`` query rows, what it keeps resident (csrc
    Config::kMinBlocksPerSm gives the launch bounds): the split planner's target and the
    heads-per-block picker's wave.  At D <= 128, SPLIT_BLOCKS_PER_SM for one row tile and for two at
    D 64 (their launch bound, 4); 3/4 of it for two row tiles at D 128, whose
    kernel takes two stages per iteration in some 160 registers (bound 3; at q_len 4 on an H200 this
    planned 1 x 131072 in 83 us instead of 93, 8 x 32768 in 143 instead of 152:
    results/h200-2026-11-30-0aa5c27); half of it for 32 rows and for D 256, whose kernels' shared
    memory keeps 2 (D 256 plain decode at 2 instead of 4: 1 x 131072 122 us instead of 138, other
    split grids 5-7 % faster: results/h200-2026-11-30-2b2aa9d)."""
    if head_dim > 128 or rows > 16:
        return max(1, SPLIT_BLOCKS_PER_SM // 2)
    if rows <= 8 or head_dim <= 64:
        return SPLIT_BLOCKS_PER_SM
    return max(1, SPLIT_BLOCKS_PER_SM * 3 // 4)


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
    _blocks_per_sm, times the SMs).  Packing h heads makes 1/h as many blocks, each h times as long,
    so it pays when the blocks take fewer waves by a
    factor of h or more; at a tie it saves each block's start and end, which won in 6 of the 8 ties
    measured (the two losses, below, were at the longer L, which the picker does not weigh).  On an H200
    (group 4; results/h200-2026-11-30-f6bc7ed): D 128, L 512, B 96 42.3 -> 33.0 us, 128 46.2 -> 40.2,
    256 75.1 -> 70.7 (ties); B 192 59.5 -> 62.7 (3 waves against 2 of twice the length: not packed).
    D 256 keeps 2 blocks per SM (results/h200-2026-11-30-93f5335): packed at B 48 / 64, L 512 49 / 49
    us instead of 56 / 58, and at B 64, L 2048 121 instead of 127; at B 40 and 48, L 2048 (ties too)
    packing was 6-7 % slower (117 against 110)."""
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
start and end cost more than the static kernels' (128 x 512 at group 4, 8 kv heads per block,
33.9-34.0 us against 32.8-33.2 with the work-queue variant that preceded it; 4 query tokens on the
12-warp kernel 56.7-56.8 against 54.6-55.2: results/h200-2026-12-01-58973a9/README.md)."""
FUSED_MIN_FILL = 0.9
"""Least share of the SMs the fused kernel's one-block-per-SM grid must fill for the planner to pick it."""
FUSED_SHARED_MEMORY = 150016
"""Shared memory of the fused kernel's largest block (D 128, two row tiles, 12 warps: csrc Config<128,
2, 1, 12>::kSmemBytes; tests/test_build.py compares).  The planner picks the fused kernel only on a device
that gives a block this much (sm_80, sm_90 and sm_100 do; sm_86, sm_89 and sm_120 give 99 KB): on
the others the launcher would run a fused plan on the static kernel, whose four blocks per SM want
four times the splits."""


def fused_fits(device) -> bool:
    """Whether ``device`` gives a thread block FUSED_SHARED_MEMORY bytes (off CUDA, where a plan is
    only bookkeeping: True)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    return limit is None or limit >= FUSED_SHARED_MEMORY


def fused_allowed(head_dim: int, group_size: int, max_query_len: int, heads_per_block: int) -> bool:
    """Whether the fused kernel serves these rows with ``heads_per_block`` kv heads per block (csrc
    decode_fused_ok): D 64 or 128, up to 8 query rows per kv head with up to 8 heads per block, or
    up to 16 rows (4 query tokens at group 4) with up to 4."""
    rows = group_size * max_query_len
    return head_dim in (64, 128) and 1 <= rows <= 16 and heads_per_block in ((1, 2, 4, 8) if rows <= 8 else (1, 2, 4))


def _plan_fused(batch_size: int, num_kv_heads: int, group_size: int, max_query_len: int, max_seq_len: int,
                head_dim: int, num_sms: int, token_major: bool) -> tuple[int, int] | None:
    """(kv heads per block, splits) for the fused kernel, or None where the static kernels are the
    better choice.  The fused kernel runs one block per SM whose warps stream the same tokens
    whole-call long, where the static kernels' four blocks per SM end one after another and a grid
    may leave a partial wave (4 query tokens at 64 x 8192: 512 blocks of 3 per SM).  It takes the
    fewest heads per block whose grid fits one block per SM, and splits to fill the rest.  In a
    token-major cache, whose adjacent kv heads share 128-byte lines, two heads at least where one head
    per block would split, as the static planner packs (plan_attention).  On an H200 with the
    row-copying kernels (NHD pages of 16, D 128, group 4; results/h200-2026-12-01-21fa567/row-copies/
    hpb.log): 1 x 131072 60.6-60.8 us at 2 heads and 33 splits against 66.4-69.1 at 1 and 16; 8 x
    32768 105.6-105.8 against 103.9-104.1 and 4 x 65536 103.6-106.2 against 104.3-104.7 (near ties);
    unsplit at 1 head, 16 x 16384 101.1 against 105.4-105.8 at 2 heads and 2 splits."""
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
    if splits > 1 and max_query_len * group_size > 8:
        return None  # two row tiles split: 1 x 131072 at 4 query tokens 74.5-74.9 us against 72.8-74.2
    return heads_per_block, splits


def heads_per_block_allowed(group_size: int, max_query_len: int, heads_per_block: int) -> bool:
    """Whether a decode thread block may serve ``heads_per_block`` kv heads (csrc
    decode_heads_per_block_ok): plain decode whose packed rows fit the 8 of one row tile."""
    return heads_per_block == 1 or (heads_per_block in (2, 4) and max_query_len == 1
                                     and heads_per_block * group_size <= 8)


def _check_heads_per_block(name: str, group_size: int, max_query_len: int, heads_per_block: int, head_dim: int,
                           fused: bool) -> None:
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
                   fused: bool | None = None, device=None, query_lens=None) -> AttentionPlan:
    """Choose the split-KV count so batch x kv_heads x splits fills the GPU, and size the workspace.

    The split count is a function of host-known bounds only, so a captured graph stays valid for
    any sequence lengths up to the ones it was planned for (longer ones just get longer splits).
    ``heads_per_block``: kv heads per thread block (1, 2 or 4; up to 8 with ``fused``); None picks it.
    ``fused``: run the fused kernel (``fused_allowed``); None lets the planner choose
    (``_plan_fused``; only when ``heads_per_block`` is None too, and, given ``device``, where
    ``fused_fits(device)``).
    ``query_lens``: the step's query lengths on the host, where the caller has them (a mixed batch):
    the decode kernel is then planned for its own requests' longest query (``decode_query_len``), and
    not launched when there are none.
    ``token_major``: the cache keeps a token's kv heads side by side (``PagedKVCache.token_major``:
    NHD pages, SGLang's token rows; ``paged_attention``'s own plan and both plugins pass it).  A grid that would split then packs 2 kv heads per block where
    they fit: at D <= 128 both heads' rows of a token lie in one 128-byte line, which one block then
    reads at once.  On an H200 (D 128, group 4, 8 kv heads, NHD pages of 16;
    results/h200-2026-11-30-495a8df): 1 x 131072 80.0 -> 67.4 us, 8 x 32768 121.5 -> 115.9,
    16 x 16384 118.0 -> 114.8, 32 x 8192 117.3 -> 116.2; head-major pages lose 1-6 % by packing there.
    """
    from . import jit
    if not (isinstance(num_sms, int) and num_sms > 0):
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    # the decode kernel's share of the call: queries up to decode_query_len tokens (longer ones are
    # the prefill kernel's, which needs no plan)
    limit = jit.decode_query_len(group_size, head_dim)
    decode_query_len = None
    if query_lens is not None:
        decode_query_len = max((int(n) for n in query_lens if 0 < int(n) <= limit), default=0)
        max_query_len = decode_query_len
    max_query_len = min(max_query_len, limit)
    if max_query_len < 1:
        return AttentionPlan(1, 0, decode_query_len=decode_query_len)
    if heads_per_block is not None:
        _check_heads_per_block("heads_per_block", group_size, max_query_len, heads_per_block, head_dim, bool(fused))
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
    slots = _blocks_per_sm(rows, head_dim) * num_sms  # one wave of blocks

    def splits_for(heads_per_block: int) -> int:
        return _splits_to_fill(_thread_blocks(batch_size, num_kv_heads, heads_per_block), slots, max_seq_len)

    if heads_per_block is None:
        heads_per_block = _pick_heads_per_block(batch_size, num_kv_heads, group_size, max_query_len, slots)
        if (token_major and heads_per_block == 1 and num_kv_heads > 1 and head_dim <= 128
                and heads_per_block_allowed(group_size, max_query_len, 2) and splits_for(1) > 1):
            heads_per_block = 2
    return plan(splits_for(heads_per_block), heads_per_block)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, k_global_scale, v_global_scale, softmax_scale: float, *,
                    max_query_len: int | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, plan: AttentionPlan | None = None,
                    workspace: torch.Tensor | None = None, seq_lens_cpu: torch.Tensor | None = None,
                    query_start_loc_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ragged queries over the paged NVFP4 cache: decode, speculative decode, prefill,
    chunked prefill, or a batch mixing them.

    q: [tokens, q_heads, D] fp16/bf16; request b owns rows query_start_loc[b]:query_start_loc[b+1]
    and sees its first seq_lens[b] cache positions (those rows are the last q_len of them;
    bottom-right causal mask).  block_table: [batch, max_pages] int32 page indices.
    Returns ``out`` ([tokens, q_heads, D], q's dtype), allocated when not given.

    Nothing is read back from the GPU when ``max_query_len`` and ``plan`` are given, or when the
    lengths are also given on the host (``seq_lens_cpu``, ``query_start_loc_cpu``: the engines have
    them), so the call captures in a CUDA graph; with ``out`` and ``workspace`` given too it
    allocates nothing.
    """
    from . import jit
    cache = _check_cache(cache)
    dev = cache.device
    _check_tensor("q", q, QUERY_DTYPES, 3, dev)
    if q.shape[2] != cache.head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has head_dim {cache.head_dim}")
    if q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {cache.num_kv_heads} kv heads")
    if dev.type == "cuda" and q.shape[1] // cache.num_kv_heads > jit.PREFILL_ROWS:
        raise ValueError(f"q has {q.shape[1]} heads, {q.shape[1] // cache.num_kv_heads} per kv head: the kernels take "
                         f"at most {jit.PREFILL_ROWS} q heads per kv head")
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dimension, got strides {q.stride()}")
    _check_tensor("block_table", block_table, (torch.int32,), 2, dev)
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    _check_tensor("seq_lens", seq_lens, (torch.int32,), 1, dev)
    _check_tensor("query_start_loc", query_start_loc, (torch.int32,), 1, dev)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must have batch + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}")
    if block_table.shape[0] < batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
    if not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or isinstance(sliding_window, bool)):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if logits_soft_cap is not None and not (logits_soft_cap >= 0 and math.isfinite(logits_soft_cap)):
        raise ValueError(f"logits_soft_cap must be positive and finite or None, got {logits_soft_cap}")
    if sinks is not None:
        _check_tensor("sinks", sinks, (torch.float32,), 1, dev)
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks must have one value per q head ({q.shape[1]}), got {sinks.shape[0]}")
    kg = _check_global_scale("k_global_scale", k_global_scale, dev)
    vg = _check_global_scale("v_global_scale", v_global_scale, dev)
    if dev.type == "cpu" and _host_checks() and batch:
        _check_ranges(q, cache, block_table, seq_lens, query_start_loc)
    if out is None:
        out = torch.zeros_like(q)
    else:
        _check_tensor("out", out, (q.dtype,), 3, dev)
        if out.shape != q.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
        if out.stride(-1) != 1:
            raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    if _host_checks():  # on every path, so the rule does not depend on the device; under
        for name, t in (("q", q), ("out", out)):  # torch.compile the binding checks the kernel's inputs
            _check_rows_aligned(name, t)
    for name, t, n in (("seq_lens_cpu", seq_lens_cpu, batch), ("query_start_loc_cpu", query_start_loc_cpu, batch + 1)):
        if t is not None:
            _check_tensor(name, t, (torch.int32, torch.int64), 1, torch.device("cpu"))
            if t.shape[0] != n:
                raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    if max_query_len is None:
        qsl = query_start_loc if query_start_loc_cpu is None else query_start_loc_cpu
        max_query_len = int((qsl[1:] - qsl[:-1]).max()) if batch else 0
    if plan is None:
        lens = seq_lens if seq_lens_cpu is None else seq_lens_cpu
        max_seq_len = int(lens.max()) if batch else 0
        query_lens = None if query_start_loc_cpu is None else (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()
        plan = plan_attention(batch, cache.num_kv_heads, q.shape[1] // cache.num_kv_heads, max(max_query_len, 1),
                              max_seq_len, cache.head_dim, num_sms(dev), token_major=cache.token_major, device=dev,
                              query_lens=query_lens)
    if not 1 <= plan.num_splits <= MAX_SPLITS:
        raise ValueError(f"plan.num_splits must lie in [1, {MAX_SPLITS}], got {plan.num_splits}")
    limit = jit.decode_query_len(q.shape[1] // cache.num_kv_heads, cache.head_dim)
    decode_len = min(max_query_len, limit)
    if plan.decode_query_len is not None:
        if not (isinstance(plan.decode_query_len, int) and 0 <= plan.decode_query_len <= limit):
            raise ValueError(f"plan.decode_query_len must be an int in [0, {limit}], got {plan.decode_query_len!r}")
        decode_len = min(plan.decode_query_len, decode_len)
    if decode_len > 0:  # no decode rows at all: the plan is not used
        _check_heads_per_block("plan.heads_per_block", q.shape[1] // cache.num_kv_heads, decode_len,
                               plan.heads_per_block, cache.head_dim, plan.fused)
    if workspace is None:
        workspace = plan.allocate_workspace(dev)
    elif workspace.device != dev:
        raise ValueError(f"workspace is on {workspace.device}, expected {dev} (the cache's device)")
    elif workspace.numel() < plan.workspace_bytes:
        raise ValueError(f"workspace holds {workspace.numel()} bytes, the plan needs {plan.workspace_bytes}")
    elif plan.num_splits > 1 and workspace.data_ptr() % 16:
        raise ValueError("workspace must be 16-byte aligned (the kernel's merge reads it in 16-byte pieces)")
    # a rotated cache (k H, v H): q H in and the output (P V H) rotated back, inside the kernel
    torch.ops.nvfp4_backend.paged_attention(
        out, q, *cache.tensors(), block_table, seq_lens, query_start_loc, kg, vg,
        float(softmax_scale), int(sliding_window or 0), float(logits_soft_cap or 0.0), sinks, int(max_query_len),
        plan.num_splits, workspace, cache.mode.rotation, plan.heads_per_block, plan.fused, decode_len)
    return out


def _kernel_aligned(k_data, k_block_scales, v_data) -> bool:
    """The decode kernel copies 16-byte pieces of data and whole scale rows and finds a token's page
    by shifting: layouts whose rows are not aligned for that (e.g. vLLM-style inline pages of one
    token) or whose page size is not a power of two take the dense path."""
    sf = k_block_scales.shape[-1]
    page_size = k_data.shape[1]
    return (page_size & (page_size - 1) == 0
            and all(st % 16 == 0 for st in k_data.stride()[:3])
            and k_data.data_ptr() % 16 == 0 and v_data.data_ptr() % 16 == 0
            and all(st % sf == 0 for st in k_block_scales.stride()[:3]) and k_block_scales.data_ptr() % sf == 0)


def _check_ranges(q, cache, block_table, seq_lens, query_start_loc) -> None:
    """Index ranges, checked where reading them is free (CPU tensors)."""
    qsl = query_start_loc.tolist()
    if any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[0] < 0 or qsl[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc must rise from >= 0 to <= {q.shape[0]} query tokens, got {qsl}")
    lens = seq_lens.tolist()
    for b, (s, a, e) in enumerate(zip(lens, qsl, qsl[1:])):
        if e - a > s:  # the queries are the last q_len of the request's seq_len positions
            raise ValueError(f"seq_lens[{b}] = {s} is shorter than the request's {e - a} query tokens")
    capacity = block_table.shape[1] * cache.page_size
    if min(lens) < 0 or max(lens) > capacity:
        raise ValueError(f"seq_lens must lie in [0, {capacity}] (block_table width x page_size), got max {max(lens)}")
    pages = [(s + cache.page_size - 1) // cache.page_size for s in lens]
    for b, n in enumerate(pages):
        row = block_table[b, :n]
        if n and (int(row.min()) < 0 or int(row.max()) >= cache.num_pages):
            raise ValueError(f"block_table row {b} holds a page outside [0, {cache.num_pages})")


def _paged_attention_impl(out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens,
                          query_start_loc, k_global_scale, v_global_scale, softmax_scale, sliding_window,
                          logits_soft_cap, sinks, max_query_len, num_splits, workspace, rotation="none",
                          heads_per_block=1, fused=False, decode_query_len=-1) -> None:
    """Requests of up to decode_query_len tokens take the decode kernel (one block per request and
    kv head holds all their rows; -1: as many as it holds, 0: none), longer ones the prefill kernel,
    launched after it on the same stream; a layout the decode kernel cannot read (_kernel_aligned)
    leaves every request to the prefill kernel.  Off CUDA, without the kernels, or at a head dim they were not built for, the
    reference."""
    from . import jit
    if not (q.is_cuda and q.shape[2] in fmt.SUPPORTED_HEAD_DIMS and jit.kernels_available(q.device)):
        rotated = rotation == "hadamard"
        cache = PagedKVCache(k_data, k_block_scales, v_data, v_block_scales)
        res = reference.paged_attention_ref(_rotate(q) if rotated else q, cache, block_table, seq_lens,
                                            query_start_loc, k_global_scale, v_global_scale, softmax_scale,
                                            sliding_window or None, logits_soft_cap or None, sinks)
        if rotated:  # the fp32 result rotated back, then rounded once into out
            res = _rotate(res)
        # rows that belong to no request are left as they were, as the kernels leave them
        first, last = int(query_start_loc[0]), int(query_start_loc[-1])
        out[first:last].copy_(res[first:last])
        return
    kernels = jit.load(q.device)
    decode_len = min(max_query_len, jit.decode_query_len(q.shape[1] // k_data.shape[2], q.shape[2]))
    if decode_query_len >= 0:
        decode_len = min(decode_len, decode_query_len)
    if not _kernel_aligned(k_data, k_block_scales, v_data):
        decode_len = 0
    if decode_len > 0:
        kernels.paged_attention(
            out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
            k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks,
            decode_len, num_splits, workspace, rotation, heads_per_block, fused)
    if max_query_len > decode_len:
        kernels.paged_prefill(
            out, q, k_data, k_block_scales, v_data, v_block_scales, block_table, seq_lens, query_start_loc,
            k_global_scale, v_global_scale, softmax_scale, sliding_window, logits_soft_cap, sinks, decode_len + 1,
            rotation)


_lib.impl("paged_attention", _paged_attention_impl, "CPU")
_lib.impl("paged_attention", _paged_attention_impl, "CUDA")


@torch.library.register_fake("nvfp4_backend::paged_attention")
def _paged_attention_fake(out, q, *args) -> None:
    return None
