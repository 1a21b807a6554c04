"""What the CUDA kernels serve: the support rules, as data, and whether the kernels run here.

The one module the engine plugins ask.  Every limit is defined here once: the build writes the
numbers into a generated C++ header (``nvfp4_limits.h``, ``jit.limits_header``) that the kernels,
their dispatch and the binding compile against, and where a number follows from a kernel's own
layout (its shared memory, its rows and heads per block) the build ``static_assert``s the two agree
(csrc/decode_limits.cu).  Shapes the kernels do not serve take the PyTorch path of the same op.
"""
from __future__ import annotations

import bisect
import logging
import os

import torch

log = logging.getLogger("nvfp4_backend")

SUPPORTED_HEAD_DIMS = (64, 128, 256)
"""Head dims the CUDA kernels are instantiated for (the reference takes any multiple of 16)."""
DECODE_MAX_ROWS = {64: 64, 128: 64, 256: 32}
"""Query rows (max_query_len x group size) one decode thread block serves, per head dim; longer
requests take the prefill kernel."""
PREFILL_ROWS = {64: 128, 128: 128, 256: 64}
"""Packed query rows (query tokens x group size) one prefill thread block holds, per head dim (two
m16 row tiles per warp up to D 128, one at D 256): the largest group the prefill kernel serves."""
MAX_SPLITS = 8192
"""Most KV splits per (request, kv head) the decode op accepts (the merge itself takes any count)."""
ROW_TILE = 8
"""Query rows of one MMA row tile of the decode kernels."""
DECODE_ROW_BANDS = (8, 16, 32, 64)
"""The query rows each static decode kernel configuration serves up to (csrc launch_for_rows)."""
DECODE_BLOCKS_PER_SM = {64: (4, 4, 2, 2), 128: (4, 3, 2, 2), 256: (2, 2, 2, 0)}
"""Thread blocks per SM the split planner aims for with the static decode kernel of each of
DECODE_ROW_BANDS, per head dim (0: no such kernel).  Never more than the kernel's launch bound
keeps resident (csrc Config::kMinBlocksPerSm, which the build checks against this table): a plan for
more leaves a partial wave.  Why each count: ``planner.blocks_per_sm``.  Shared memory is not checked:
D 128's four-row-tile kernels (74 and 82 KB a block) keep 2 resident on sm_90 and sm_100, but one on
sm_80 at 33-64 rows and on sm_86, sm_89 and sm_120 (docs/decisions.md, Open)."""
PACKED_MAX_HEADS = 4
"""Most kv heads one static decode block packs (plain decode, all packed rows in one row tile)."""
FUSED_HEAD_DIMS = (64, 128)
FUSED_MAX_ROWS = 16
"""Most query rows per kv head of the fused decode kernel (two row tiles)."""
FUSED_HEAD_TILES = 8
"""kv heads x row tiles one fused block holds: up to 8 heads of one row tile, 4 of two."""
FUSED_SHARED_MEMORY = 150016
"""Shared memory of the fused kernel's largest block (D 128, two row tiles, 12 warps: csrc Config<128,
2, 1, 12>::kSmemBytes, which the build checks against this number).  The planner picks the fused
kernel only on a device that gives a block this much (sm_80, sm_90 and sm_100 do; sm_86, sm_89 and
sm_120 give 99 KB): on the others the launcher would run a fused plan on the static kernel, whose four
blocks per SM want four times the splits."""


def decode_max_rows(head_dim: int) -> int:
    """Query rows one decode thread block serves at ``head_dim`` (0: no decode kernel for it)."""
    return DECODE_MAX_ROWS.get(head_dim, 0)


def decode_blocks_per_sm(rows: int, head_dim: int) -> int:
    """DECODE_BLOCKS_PER_SM's count for the static decode kernel of ``rows`` query rows."""
    return DECODE_BLOCKS_PER_SM[head_dim][min(bisect.bisect_left(DECODE_ROW_BANDS, rows), len(DECODE_ROW_BANDS) - 1)]


def decode_supports(group_size: int, max_query_len: int, head_dim: int) -> bool:
    """Whether one decode thread block holds all query rows of a (request, kv head)."""
    return 0 < max_query_len * group_size <= decode_max_rows(head_dim)


def decode_query_len(group_size: int, head_dim: int) -> int:
    """The longest query (tokens) the decode kernel serves at this group size; longer ones are the
    prefill kernel's (0: none)."""
    return decode_max_rows(head_dim) // group_size if group_size > 0 else 0


def prefill_rows(head_dim: int) -> int:
    """Packed query rows one prefill thread block holds at ``head_dim`` (0: no prefill kernel for it):
    the largest group size it serves."""
    return PREFILL_ROWS.get(head_dim, 0)


def kernels_serve_any_batch(group_size: int, head_dim: int) -> bool:
    """Whether one call on the kernels serves any batch of this shape, every mix of decodes, spec rows
    and prefill chunks, without the host: the decode kernel holds a one-token request's rows and the
    prefill kernel the longer ones.  Such a call captures in a CUDA graph that replays any batch
    written into the same buffers (an engine's FULL graphs for mixed batches)."""
    return decode_supports(group_size, 1, head_dim) and group_size <= prefill_rows(head_dim)


def _power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def heads_per_block_allowed(group_size: int, max_query_len: int, heads_per_block: int) -> bool:
    """Whether a static decode thread block may serve ``heads_per_block`` kv heads: one, or up to
    PACKED_MAX_HEADS in plain decode whose packed rows fit one row tile."""
    return heads_per_block == 1 or (_power_of_two(heads_per_block) and heads_per_block <= PACKED_MAX_HEADS
                                     and max_query_len == 1 and heads_per_block * group_size <= ROW_TILE)


def fused_allowed(head_dim: int, group_size: int, max_query_len: int, heads_per_block: int) -> bool:
    """Whether the fused kernel serves these rows with ``heads_per_block`` kv heads per block: D 64 or
    128, up to 8 query rows per kv head with up to 8 heads per block, or up to 16 rows (4 query
    tokens at group 4) with up to 4."""
    rows = group_size * max_query_len
    return (head_dim in FUSED_HEAD_DIMS and 1 <= rows <= FUSED_MAX_ROWS and _power_of_two(heads_per_block)
            and heads_per_block * -(-rows // ROW_TILE) <= FUSED_HEAD_TILES)


def fused_fits(device) -> bool:
    """Whether ``device`` gives a thread block FUSED_SHARED_MEMORY bytes (off CUDA, where a plan is
    only bookkeeping: True)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    return limit is None or limit >= FUSED_SHARED_MEMORY


def decode_kernel_serves(k_data: torch.Tensor, k_block_scales: torch.Tensor, v_data: torch.Tensor) -> bool:
    """The decode kernel copies 16-byte pieces of data and whole scale rows and finds a token's page
    by shifting: layouts whose rows are not aligned for that (e.g. vLLM-style inline pages of one
    token) or whose page size is not a power of two run every request on the prefill kernel."""
    sf = k_block_scales.shape[-1]
    page_size = k_data.shape[1]
    return (page_size & (page_size - 1) == 0
            and all(st % 16 == 0 for st in k_data.stride()[:3])
            and k_data.data_ptr() % 16 == 0 and v_data.data_ptr() % 16 == 0
            and all(st % sf == 0 for st in k_block_scales.stride()[:3]) and k_block_scales.data_ptr() % sf == 0)


_unavailable: dict[tuple[int, int], str] = {}


def kernels_available(device: torch.device) -> bool:
    """True when the kernels are built (or build now) for ``device``; otherwise warn once."""
    if os.environ.get("NVFP4_BACKEND_KERNELS", "1") == "0":
        return False
    cap = torch.cuda.get_device_capability(device)
    if cap in _unavailable:
        return False
    if cap < (8, 0):
        _unavailable[cap] = f"compute capability {cap} is below 8.0 (the kernels need SM80+: mma.sync m16n8k16, cp.async)"
    else:
        from . import jit
        try:
            jit.load(torch.device(device))
            return True
        except Exception as exc:  # the build environment is the user's; say why and fall back
            _unavailable[cap] = f"{type(exc).__name__}: {exc}"
    log.warning("nvfp4-backend CUDA kernels unavailable on %s (%s); using the PyTorch reference",
                device, _unavailable[cap])
    return False


def unavailable_reason(capability: tuple[int, int]) -> str | None:
    """Why kernels_available said no for a device of ``capability`` (None if it did not)."""
    return _unavailable.get(capability)
