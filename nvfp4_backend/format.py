"""The NVFP4 KV-cache format: the one place that defines it.

An element is FP4 E2M1 (sign bit 3, magnitude code in bits 2..0 indexing E2M1_MAGNITUDES), two per
byte with element 2i in the LOW nibble of byte i.  Every 16 consecutive head-dim elements of one
token and one head share an FP8 E4M3 block scale (stored as its raw byte).  One fp32 global scale
per layer and per K/V is the DEQUANT multiplier (the engines' ``k_scale`` / ``v_scale``):

    value = e2m1(code) * e4m3(block_scale) * global_scale

Quantization, bit for bit (the CUDA writer follows the same fp32 operations in the same order):

    scaled  = x * (1 / global_scale)                    # fp32, reciprocal rounded once
    sf      = e4m3_rne_satfinite(amax(|scaled| over 16) / 6)
    codes   = e2m1_rne_satfinite(scaled * (1 / e4m3(sf)))   # all zero when sf == 0

Defined behaviour for values the format cannot hold:
  * |x| beyond 6 * 448 * global_scale saturates to +-6 * 448 * global_scale (``satfinite``);
    +-Inf saturates the same way.
  * a block holding any NaN stores the E4M3 NaN byte (0x7F) as its scale and all-zero codes, so
    the whole block reads back as NaN: a NaN is never silently turned into a number.
  * -0.0 and values that round to zero keep their sign (code 0x8 reads back as -0.0).
"""
from __future__ import annotations

import math

import torch

BLOCK_SIZE = 16
"""Head-dim elements that share one E4M3 block scale."""
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8
E4M3_MAX = 448.0
E4M3_NAN_BYTE = 0x7F
FP4_PER_BYTE = 2
HEAD_DIM_MULTIPLE = BLOCK_SIZE

# Round-to-nearest-even decision points between consecutive magnitude codes i and i+1.  A tie
# goes to the even code: it stays down after an even code (i even) and goes up after an odd one.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def data_bytes(head_dim: int) -> int:
    """Packed E2M1 bytes of one token-head."""
    return head_dim // FP4_PER_BYTE


def scale_bytes(head_dim: int) -> int:
    """E4M3 block-scale bytes of one token-head."""
    return head_dim // BLOCK_SIZE


def bytes_per_token_head(head_dim: int) -> int:
    """Cache bytes one token of one kv head takes for K (or for V): 72 at head_dim 128."""
    return data_bytes(head_dim) + scale_bytes(head_dim)


def check_head_dim(head_dim: int, name: str = "head_dim") -> None:
    if head_dim <= 0 or head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(f"{name} must be a positive multiple of {HEAD_DIM_MULTIPLE}, got {head_dim}")


# ----------------------------------------------------------------------------- E2M1 codec
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit codes (uint8 0..15), round-to-nearest-even, saturating at +-6.

    NaN encodes as +0 (the block-level quantizer marks NaN blocks through the scale instead).
    """
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        up = (mag >= mid) if i % 2 else (mag > mid)
        code += up.to(torch.uint8)
    sign = torch.signbit(x) & ~torch.isnan(x)
    return code | (sign.to(torch.uint8) << 3)


_E2M1_TABLE_CACHE: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 code values as fp32 (code 8 is -0.0)."""
    device = torch.device(device)
    table = _E2M1_TABLE_CACHE.get(device)
    if table is None:
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
        table = torch.cat([mags, -mags]).to(device)
        _E2M1_TABLE_CACHE[device] = table
    return table


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_table(codes.device)[(codes & 0xF).long()]


# ----------------------------------------------------------------------------- E4M3 codec
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 bytes, round-to-nearest-even, saturating at +-448 (Inf too); NaN -> 0x7F.

    The clamp is explicit so the result never depends on how a torch version or device casts
    out-of-range values.
    """
    x = x.float()
    nan = torch.isnan(x)
    clamped = torch.where(nan, torch.zeros_like(x), x.clamp(-E4M3_MAX, E4M3_MAX))
    out = clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(nan, torch.full_like(out, E4M3_NAN_BYTE), out)


def e4m3_decode(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------- packing
def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D/2] bytes, element 2i in the low nibble of byte i."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- blocks
def _as_fp32_scalar(global_scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(global_scale, dtype=torch.float32, device=device).reshape(())


SCALE_RULES = ("6", "6or4")
"""How a block's E4M3 scale is chosen: "6" maps the block maximum to 6 (the standard recipe);
"6or4" also tries mapping it to 4 and keeps whichever reconstructs the block with the smaller
squared error (vLLM's ``nvfp4_4over6`` idea).  Both produce the standard NVFP4 bytes."""


def _block_codes(blocks: torch.Tensor, amax: torch.Tensor, target: float):
    """Scale bytes, their values and the codes for a block maximum mapped onto ``target``."""
    sf = e4m3_encode(amax / torch.full_like(amax, target))
    sf_value = e4m3_decode(sf)
    inv = torch.where(sf_value > 0, torch.ones_like(sf_value) / sf_value, torch.zeros_like(sf_value))
    return sf, sf_value, e2m1_encode(blocks * inv.unsqueeze(-1))


def _block_sq_error(blocks: torch.Tensor, codes: torch.Tensor, sf_value: torch.Tensor) -> torch.Tensor:
    """Squared reconstruction error per block in fp32, accumulated in element order 0..15 (a fixed
    order, so a kernel can reproduce the comparison bit for bit)."""
    diff = blocks - e2m1_decode(codes) * sf_value.unsqueeze(-1)
    err = torch.zeros_like(sf_value)
    for i in range(BLOCK_SIZE):
        err = err + diff[..., i] * diff[..., i]
    return err


def quantize(x: torch.Tensor, global_scale: torch.Tensor | float,
             scale_rule: str = "6") -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] fp16/bf16/fp32 -> (packed [..., D/2] uint8, block scales [..., D/16] uint8).

    ``scale_rule`` "6or4": per block, the scale for a maximum of 4 wins only when its squared
    error is strictly smaller (a tie keeps the standard scale).
    """
    check_head_dim(x.shape[-1], "x.shape[-1]")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    # Tensor-by-tensor divisions only: torch turns a division by a Python scalar into a multiply by
    # its reciprocal on some devices, which would round differently from the kernel.
    g = _as_fp32_scalar(global_scale, x.device)
    enc = torch.ones_like(g) / g
    blocks = (x.float() * enc).unflatten(-1, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(-1)  # NaN propagates
    sf, sf_value, codes = _block_codes(blocks, amax, E2M1_MAX)
    if scale_rule == "6or4":
        sf4, sf4_value, codes4 = _block_codes(blocks, amax, 4.0)
        four = _block_sq_error(blocks, codes4, sf4_value) < _block_sq_error(blocks, codes, sf_value)
        sf = torch.where(four, sf4, sf)
        codes = torch.where(four.unsqueeze(-1), codes4, codes)
    codes = torch.where((sf == E4M3_NAN_BYTE).unsqueeze(-1), torch.zeros_like(codes), codes)
    return pack_fp4(codes.flatten(-2)), sf


def hadamard(head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size head_dim (a power of two).

    It is symmetric and its own inverse, so with k' = k H and q' = q H, q'.k' = q.k, and an output
    computed from v' = v H is un-rotated by one more product with H.
    """
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for a Hadamard rotation, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / h.shape[0] ** 0.5).to(device=device, dtype=dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x H`` along the last dimension (H = ``hadamard(D)``), in fp32, by the fast Walsh-Hadamard
    transform: butterflies (a, b) -> (a + b, a - b) on the pairs (i, i + h) for h = 1, 2, 4, ...,
    D/2, then one multiply by float32(1/sqrt(D)).

    These fp32 operations, in this order, define the writer's rotation of K and V (KV mode
    "hadamard"): the CUDA writer performs the same ones (inside a thread for h < 16, across the
    lanes holding a token-head's blocks above), so both store the same bytes.
    """
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for a Hadamard rotation, got {d}")
    y = x.float()
    h = 1
    while h < d:
        pairs = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return y * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


def dequantize(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed [..., D/2], block scales [..., D/16]) -> values [..., D] in ``dtype``."""
    values = e2m1_decode(unpack_fp4(packed)).to(dtype).unflatten(-1, (-1, BLOCK_SIZE))
    scale = e4m3_decode(block_scales).to(dtype).unsqueeze(-1)
    g = torch.as_tensor(global_scale, dtype=dtype, device=packed.device).reshape(())
    return (values * scale).flatten(-2) * g


# ----------------------------------------------------------------------------- global scale
def representable_max(global_scale: float) -> float:
    """Largest magnitude a cache with this global scale holds without saturating."""
    return E2M1_MAX * E4M3_MAX * global_scale


def calibrate_global_scale(amax: float | torch.Tensor, headroom: float = 1.0) -> float:
    """Global (dequant) scale that maps ``amax * headroom`` onto the format's largest value.

    Policy (used by both plugins and the eval): a static scale from the checkpoint
    (``k_scale``/``v_scale``) when the model has one; otherwise 1.0, the engines' default, which
    holds |x| <= 2688 without saturation; ``calibrate_global_scale`` is the opt-in alternative
    that fits the observed amax.  Values beyond the range saturate (never overflow to Inf).
    """
    amax = float(amax)
    if not amax == amax or amax in (float("inf"), float("-inf")):
        raise ValueError(f"amax must be finite, got {amax}")
    if headroom <= 0:
        raise ValueError(f"headroom must be positive, got {headroom}")
    if amax <= 0:
        return 1.0
    return amax * headroom / (E2M1_MAX * E4M3_MAX)
