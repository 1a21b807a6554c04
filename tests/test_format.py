"""The NVFP4 format: E2M1 / E4M3 codecs, packing, the block quantizer and its error bound.

The oracles here are written from the bit-level definitions of the two formats and from the fp32
operation order in ``format.py``'s docstring, in plain Python floats (numpy.float32 for each fp32
rounding), never from the vectorized code under test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_backend import format as fmt

F32 = np.float32


def next32(x: float, toward: float) -> float:
    """The fp32 neighbour of x (an fp32 value) in the direction of toward."""
    return float(np.nextafter(F32(x), F32(toward)))


# ============================================================================ scalar definitions
def e2m1_value(code: int) -> float:
    """Bit-level E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return math.copysign(mag, sign)


def e4m3_value(byte: int) -> float:
    """Bit-level E4M3 (fn variant): sign bit 7, exponent bits 6..3 (bias 7), 3 mantissa bits;
    S.1111.111 is NaN and there is no infinity."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    mag = man * 2.0 ** -9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return math.copysign(mag, sign)


E2M1_VALUES = {e2m1_value(c): c for c in range(16)}          # -0.0 == 0.0, so keyed by magnitude below
E4M3_BYTE_OF = {e4m3_value(b): b for b in range(0x7F)}       # non-negative finite bytes


def rne_on_grid(a: float, quantum: float) -> float:
    """a rounded to a multiple of quantum, ties to even multiples (Python's round is half-even)."""
    return round(a / quantum) * quantum


def e2m1_encode_scalar(v: float) -> int:
    """fp32 value -> E2M1 code: RNE on the E2M1 grid, saturating at 6, NaN -> +0, sign kept."""
    if math.isnan(v):
        return 0
    a = min(abs(v), 6.0)
    quantum = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)  # an even multiple is an even mantissa
    mag = min(rne_on_grid(a, quantum), 6.0)
    code = [e2m1_value(c) for c in range(8)].index(mag)
    return code | (0x8 if math.copysign(1.0, v) < 0 else 0)


def e4m3_encode_scalar(v: float) -> int:
    """fp32 value -> E4M3 byte: RNE, saturating at 448 (Inf too), NaN -> 0x7F, sign kept."""
    if math.isnan(v):
        return 0x7F
    a = min(abs(v), 448.0)
    if a < 2.0 ** -6:
        quantum = 2.0 ** -9                                  # subnormal spacing
    else:
        quantum = 2.0 ** (math.frexp(a)[1] - 1 - 3)         # 3 mantissa bits below the leading one
    mag = min(rne_on_grid(a, quantum), 448.0)
    return E4M3_BYTE_OF[mag] | (0x80 if math.copysign(1.0, v) < 0 else 0)


def quantize_scalar(x: list[float], global_scale: float) -> tuple[list[int], list[int]]:
    """One row of D fp32 values -> (codes [D], scale bytes [D/16]), in format.py's documented order:

        scaled = x * (1 / g); sf = e4m3(amax / 6); codes = e2m1(scaled * (1 / e4m3(sf)))
    """
    codes, sfs = [], []
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        enc = F32(1.0) / F32(global_scale)
        for start in range(0, len(x), 16):
            scaled = [F32(v) * enc for v in x[start:start + 16]]
            amax = F32(math.nan) if any(math.isnan(s) for s in scaled) else max(abs(s) for s in scaled)
            sf = e4m3_encode_scalar(float(amax / F32(6.0)))
            sfs.append(sf)
            if sf == 0x7F:
                codes += [0] * 16
                continue
            sf_value = F32(e4m3_value(sf))
            inv = F32(1.0) / sf_value if sf_value > 0 else F32(0.0)
            codes += [e2m1_encode_scalar(float(s * inv)) for s in scaled]
    return codes, sfs


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] codes, element 2i from the low nibble (independent of unpack_fp4)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def assert_quantize_matches_scalar(x: torch.Tensor, global_scale: float) -> None:
    packed, sf = fmt.quantize(x, global_scale)
    assert packed.dtype == torch.uint8 and sf.dtype == torch.uint8
    assert packed.shape == (*x.shape[:-1], x.shape[-1] // 2) and sf.shape == (*x.shape[:-1], x.shape[-1] // 16)
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    codes = codes_of(packed).reshape(len(rows), -1).tolist()
    sfs = sf.reshape(len(rows), -1).tolist()
    for i, row in enumerate(rows):
        want_codes, want_sf = quantize_scalar(row, global_scale)
        assert sfs[i] == want_sf, f"row {i}: scales {sfs[i]} != {want_sf} for {row}"
        assert codes[i] == want_codes, f"row {i}: codes {codes[i]} != {want_codes} for {row}"


# ============================================================================ constants
def test_e2m1_magnitudes_match_bit_definition():
    assert fmt.E2M1_MAGNITUDES == tuple(e2m1_value(c) for c in range(8))
    assert fmt.E2M1_MAX == max(fmt.E2M1_MAGNITUDES)
    assert fmt.E4M3_MAX == max(e4m3_value(b) for b in range(0x7F))
    assert math.isnan(e4m3_value(fmt.E4M3_NAN_BYTE))


@pytest.mark.parametrize("head_dim, data, scales, total", [(64, 32, 4, 36), (128, 64, 8, 72), (256, 128, 16, 144)])
def test_bytes_per_token_head(head_dim, data, scales, total):
    assert fmt.data_bytes(head_dim) == data
    assert fmt.scale_bytes(head_dim) == scales
    assert fmt.bytes_per_token_head(head_dim) == total


@pytest.mark.parametrize("head_dim", [0, -16, 8, 40, 100])
def test_check_head_dim_rejects(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        fmt.check_head_dim(head_dim)


# ============================================================================ E2M1
def test_e2m1_all_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = fmt.e2m1_decode(codes)
    assert values.dtype == torch.float32
    for c in range(16):
        want = e2m1_value(c)
        assert values[c].item() == want and math.copysign(1, values[c].item()) == math.copysign(1, want), c
    assert torch.equal(fmt.e2m1_encode(values), codes)


@pytest.mark.parametrize("k", range(7), ids=lambda k: f"mid{k}")
def test_e2m1_ties_round_to_even(k):
    """The midpoint between codes k and k+1 goes to the even code:
    0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4."""
    lo, hi = fmt.E2M1_MAGNITUDES[k], fmt.E2M1_MAGNITUDES[k + 1]
    x = (lo + hi) / 2
    want = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}[x]
    even = k if k % 2 == 0 else k + 1
    assert fmt.E2M1_MAGNITUDES[even] == want
    below, above = next32(x, 0.0), next32(x, 10.0)
    got = fmt.e2m1_encode(torch.tensor([x, -x, below, above], dtype=torch.float32)).tolist()
    assert got == [even, even | 0x8, k, k + 1]   # one ulp off the tie: the nearer neighbour


@pytest.mark.parametrize("x", [5.0001, 5.5, 6.0, 6.5, 7.0, 100.0, 1e9, 3.0e38, math.inf])
def test_e2m1_saturates_at_six(x):
    got = fmt.e2m1_encode(torch.tensor([x, -x], dtype=torch.float32)).tolist()
    assert got == [7, 15]


def test_e2m1_negative_zero_and_nan():
    got = fmt.e2m1_encode(torch.tensor([0.0, -0.0, -0.1, -0.25, math.nan, -math.nan])).tolist()
    assert got == [0, 8, 8, 8, 0, 0]   # signed zeros keep their sign; NaN encodes as +0 (documented)


def test_e2m1_encode_matches_scalar_on_dense_sweep(gen):
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + list(fmt.E2M1_MAGNITUDES)
    near = [next32(m, d) for m in midpoints for d in (-1.0, 10.0)]
    sweep = torch.cat([torch.linspace(-7, 7, 4001), torch.tensor(midpoints + near),
                       torch.randn(2000, generator=gen) * 3]).float()
    sweep = torch.cat([sweep, -sweep])
    got = fmt.e2m1_encode(sweep).tolist()
    assert got == [e2m1_encode_scalar(v) for v in sweep.tolist()]


# ============================================================================ E4M3
def test_e4m3_all_bytes_decode_and_round_trip():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = fmt.e4m3_decode(raw)
    for b in range(256):
        want, got = e4m3_value(b), values[b].item()
        if math.isnan(want):
            assert math.isnan(got), b
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), b
    back = fmt.e4m3_encode(values)
    nan = torch.tensor([math.isnan(e4m3_value(b)) for b in range(256)])
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(back[~nan], raw[~nan])
    # both NaN bytes read back as NaN and re-encode to the one canonical NaN byte (documented)
    assert back[nan].tolist() == [fmt.E4M3_NAN_BYTE, fmt.E4M3_NAN_BYTE]


@pytest.mark.parametrize("x", [448.0, 448.5, 463.99, 464.0, 500.0, 1e4, 3.0e38, math.inf])
def test_e4m3_saturates_at_448(x):
    got = fmt.e4m3_encode(torch.tensor([x, -x], dtype=torch.float32)).tolist()
    assert [e4m3_value(b) for b in got] == [448.0, -448.0]


SUB = 2.0 ** -9


@pytest.mark.parametrize("x, value", [
    (SUB / 2, 0.0),                              # tie between 0 and the smallest subnormal -> 0 (even)
    (next32(SUB / 2, 1), SUB),
    (SUB / 4, 0.0),
    (SUB * 1.5, 2 * SUB),                        # tie between mantissas 1 and 2 -> 2
    (SUB * 2.5, 2 * SUB),                        # tie between 2 and 3 -> 2
    (SUB * 3.5, 4 * SUB),
    (SUB * 7.5, 8 * SUB),                        # tie between the largest subnormal and 2^-6 -> 2^-6
    (SUB * 7.4, 7 * SUB),
    (2.0 ** -6 * (1 + 1 / 16), 2.0 ** -6),       # first normal binade, tie -> even mantissa 0
    (2.0 ** -6 * (1 + 3 / 16), 2.0 ** -6 * (1 + 2 / 8)),
], ids=lambda v: repr(v))
def test_e4m3_subnormal_rounding(x, value):
    got = fmt.e4m3_encode(torch.tensor([x, -x], dtype=torch.float32)).tolist()
    assert [e4m3_value(b) for b in got] == [value, -value]
    assert got[1] == got[0] | 0x80


def test_e4m3_nan_and_signed_zero():
    got = fmt.e4m3_encode(torch.tensor([math.nan, -math.nan, 0.0, -0.0])).tolist()
    assert got == [0x7F, 0x7F, 0x00, 0x80]


def test_e4m3_encode_matches_scalar_on_sweep(gen):
    """Random fp32 values over every binade of E4M3 (and beyond), plus every midpoint +- 1 ulp."""
    mags = torch.exp2(torch.rand(20000, generator=gen) * 24 - 14)       # 2^-14 .. 2^10
    finite = sorted(e4m3_value(b) for b in range(0x7F))
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])]
    near = [next32(m, d) for m in mids for d in (0.0, 1e9)]
    sweep = torch.cat([mags, torch.tensor(mids + near + finite)]).float()
    sweep = torch.cat([sweep, -sweep])
    got = fmt.e4m3_encode(sweep).tolist()
    assert got == [e4m3_encode_scalar(v) for v in sweep.tolist()]


# ============================================================================ packing
def test_pack_order_against_hand_computed_bytes():
    codes = torch.tensor([0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x8, 0x7], dtype=torch.uint8)
    packed = fmt.pack_fp4(codes)
    assert packed.tolist() == [0x21, 0x43, 0x0F, 0x78]       # element 2i in the LOW nibble of byte i
    assert torch.equal(fmt.unpack_fp4(packed), codes)


def test_pack_unpack_all_bytes(gen):
    raw = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=gen)
    assert torch.equal(fmt.pack_fp4(fmt.unpack_fp4(raw)), raw)
    assert torch.equal(fmt.unpack_fp4(raw), codes_of(raw))


def test_quantize_hand_computed_block():
    """amax 6 -> scale 1.0 (E4M3 byte 0x38); codes 0.5->1, 1.0->2, -0.5->9, 6->7, -3->13, 0.3->1."""
    x = torch.zeros(32)
    x[:6] = torch.tensor([0.5, 1.0, -0.5, 6.0, -3.0, 0.3])
    x[16:18] = torch.tensor([-12.0, 1.0])                       # second block: amax 12 -> scale 2.0 (0x40)
    packed, sf = fmt.quantize(x, 1.0)
    assert sf.tolist() == [0x38, 0x40]
    assert packed.tolist() == [0x21, 0x79, 0x1D] + [0] * 5 + [0x1F] + [0] * 7   # 1.0/2 -> 0.5 -> code 1
    deq = fmt.dequantize(packed, sf, 1.0)
    assert deq[:6].tolist() == [0.5, 1.0, -0.5, 6.0, -3.0, 0.5]
    assert deq[16:18].tolist() == [-12.0, 1.0]


def test_quantize_global_scale_is_dequant_multiplier():
    x = torch.zeros(16)
    x[0] = 6.0 * 3.0                                           # g = 3: scaled amax 6 -> scale 1.0
    packed, sf = fmt.quantize(x, 3.0)
    assert sf.tolist() == [0x38] and packed[0].item() == 0x07
    assert fmt.dequantize(packed, sf, 3.0)[0].item() == 18.0


# ============================================================================ special values
def test_quantize_nan_block_reads_back_nan():
    x = torch.full((2, 48), 6.0)                               # scale 1.0 (0x38), code 7: exact
    x[0, 20] = math.nan                                        # block 1 of row 0
    x[1, 47] = -math.nan                                       # block 2 of row 1
    packed, sf = fmt.quantize(x, 1.0)
    assert sf[0].tolist() == [0x38, 0x7F, 0x38] and sf[1].tolist() == [0x38, 0x38, 0x7F]
    codes = codes_of(packed)
    assert codes[0, 16:32].eq(0).all() and codes[1, 32:48].eq(0).all()
    deq = fmt.dequantize(packed, sf, 1.0)
    nan = torch.zeros(2, 48, dtype=torch.bool)
    nan[0, 16:32] = True
    nan[1, 32:48] = True
    assert torch.equal(deq.isnan(), nan)
    assert torch.equal(deq[~nan], torch.full((64,), 6.0))


@pytest.mark.parametrize("g", [1.0, 0.25, 3.0])
def test_quantize_inf_saturates(g):
    x = torch.full((32,), 0.5)
    x[3], x[20] = math.inf, -math.inf
    packed, sf = fmt.quantize(x, g)
    assert sf.tolist() == [0x7E, 0x7E]                        # 448
    deq = fmt.dequantize(packed, sf, g)
    assert deq[3].item() == fmt.representable_max(g) == 6 * 448 * g
    assert deq[20].item() == -fmt.representable_max(g)
    assert torch.isfinite(deq).all()
    assert_quantize_matches_scalar(x, g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_beyond_range_saturates(dtype):
    g = 0.01
    x = torch.tensor([30.0, -1e3, 27.0, 26.0] + [0.0] * 12).to(dtype)   # max 26.88 at g=0.01
    deq = fmt.dequantize(*fmt.quantize(x, g), g)
    assert deq[0].item() == pytest.approx(26.88, rel=1e-6) and deq[1].item() == pytest.approx(-26.88, rel=1e-6)
    assert deq.abs().max().item() == pytest.approx(fmt.representable_max(g), rel=1e-6)


def test_quantize_signed_zeros():
    x = torch.zeros(3, 16)
    x[0] = -0.0
    x[1, :2] = torch.tensor([6.0, -0.1])                      # rounds to zero, keeps its sign
    packed, sf = fmt.quantize(x, 1.0)
    assert sf.tolist() == [[0], [0x38], [0]]
    assert codes_of(packed)[0].tolist() == [8] * 16 and codes_of(packed)[2].tolist() == [0] * 16
    assert codes_of(packed)[1, 1].item() == 8
    deq = fmt.dequantize(packed, sf, 1.0)
    assert deq[0].signbit().all() and not deq[2].signbit().any() and deq[1, 1].signbit()
    assert deq.abs()[0].eq(0).all()


# ============================================================================ bit-exact vs the scalar definition
def make_data(kind: str, gen: torch.Generator, shape=(24, 2, 64)) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":         # a few huge values per row: small ones collapse onto few codes
        mask = torch.rand(shape, generator=gen) < 0.03
        x = torch.where(mask, x * 300, x)
    elif kind == "tiny":           # block scales in E4M3's subnormal range (amax/6 < 2^-6)
        x = x * torch.exp2(-torch.randint(6, 16, shape[:-1] + (1,), generator=gen).float())
    elif kind == "huge":           # block scales at and beyond 448: saturation
        x = x * 2000
    elif kind == "mixed_binades":  # every block its own binade, 2^-20 .. 2^12
        blocks = x.unflatten(-1, (-1, 16))
        x = (blocks * torch.exp2(torch.randint(-20, 13, blocks.shape[:-1] + (1,), generator=gen).float())).flatten(-2)
    return x


@pytest.mark.parametrize("g", [1.0, 0.37, 1 / 448, 7.5, 2.0 ** -20])
@pytest.mark.parametrize("kind", ["random", "outliers", "tiny", "huge", "mixed_binades"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_scalar_definition(kind, g, dtype, gen):
    assert_quantize_matches_scalar(make_data(kind, gen, (6, 2, 64)).to(dtype), g)


def ulps_around(v: float, k: int = 4) -> list[float]:
    """fp32 values within k ulps of fp32(v)."""
    out, lo, hi = [float(F32(v))], float(F32(v)), float(F32(v))
    for _ in range(k):
        lo, hi = next32(lo, -math.inf), next32(hi, math.inf)
        out += [lo, hi]
    return out


@pytest.mark.parametrize("g", [1.0, 0.75])
def test_quantize_matches_scalar_at_rounding_decision_points(g, gen):
    """Data placed on (and a few ulps around) every rounding decision of both stages, where the
    order and kind of each fp32 operation (divide vs multiply by a reciprocal) decides the bits."""
    finite = sorted(e4m3_value(b) for b in range(0x7F))
    blocks = []
    # stage 1: block amax on every E4M3 midpoint (times 6 * g), incl. the 448 / 464 saturation edge
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])] + [464.0]
    for m in mids:
        for a in ulps_around(6 * m * g):
            tail = (torch.rand(15, generator=gen) * 2 - 1) * a
            blocks.append(torch.cat([torch.tensor([a]), tail]))
    # stage 2: for every block scale s, elements on and around every E2M1 midpoint times s
    e2m1_mids = [(a + b) / 2 for a, b in zip(fmt.E2M1_MAGNITUDES, fmt.E2M1_MAGNITUDES[1:])]
    for s in finite[1::3]:
        vals = [v * sign for m in e2m1_mids for v in ulps_around(m * s * g, 2) for sign in (1, -1)]
        for i in range(0, len(vals), 15):
            chunk = vals[i:i + 15]
            blocks.append(torch.tensor([6 * s * g] + chunk + [0.0] * (15 - len(chunk))))
    x = torch.stack(blocks).float()
    assert_quantize_matches_scalar(x.reshape(-1, 64) if x.shape[0] % 4 == 0 else x, g)


@st.composite
def rows(draw):
    d = draw(st.sampled_from([16, 32, 48]))
    n = draw(st.integers(1, 3))
    special = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 6.0, 5.0, 2.5, 448.0 * 6])
    finite = st.floats(-1e6, 1e6, width=32)
    tiny = st.floats(-2.0 ** -10, 2.0 ** -10, width=32)
    elem = st.one_of(finite, tiny, special)
    values = draw(st.lists(elem, min_size=n * d, max_size=n * d))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return torch.tensor(values, dtype=torch.float32).reshape(n, d).to(dtype)


@settings(max_examples=150)
@given(x=rows(), g=st.floats(2.0 ** -40, 2.0 ** 40, width=32))
def test_quantize_matches_scalar_definition_hypothesis(x, g):
    assert_quantize_matches_scalar(x, g)


# ============================================================================ error bound
def half_step_bound(x: torch.Tensor, packed: torch.Tensor, sf: torch.Tensor, g: float) -> torch.Tensor:
    """Per-element bound on |x - dequant(x)| (fp64), derived from the grid.

    With s = e4m3(sf) * g the block's dequant step unit and y = x / s, E2M1 RNE keeps |y| <= 6 within
    half the grid spacing at |y|: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6] -> error <= s * that.
    Beyond 6 the element saturates: the output is exactly +-6s, error |x| - 6s (bounded per block by
    ``test_saturation_is_bounded_by_scale_rounding`` except at the 448 cap).  When the scale byte is
    0 every code is zero and the error is |x| itself (<= 6 * 2^-10 * g, also checked there).
    The fp32 arithmetic of the quantizer moves y by a few ulp: slack 1e-6 * |x|.
    """
    x = x.double()
    s = (fmt.e4m3_decode(sf).double() * g).repeat_interleave(16, -1)
    y = (x / s).abs()
    half = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0)) * s
    saturated = (x.abs() - 6 * s).clamp(min=0)
    bound = torch.where(y <= 6, half, saturated)
    bound = torch.where(s == 0, x.abs(), bound)
    return bound + 1e-6 * x.abs() + 1e-300


@pytest.mark.parametrize("g", [1.0, 0.05, 3.0])
@pytest.mark.parametrize("kind", ["random", "outliers", "tiny", "huge", "mixed_binades"])
def test_quantize_error_within_half_step(kind, g, gen):
    g = float(F32(g))                                          # the fp32 value the format stores
    x = make_data(kind, gen) * g
    packed, sf = fmt.quantize(x, g)
    deq = fmt.dequantize(packed, sf, g, torch.float64)
    err = (x.double() - deq).abs()
    bound = half_step_bound(x, packed, sf, g)
    worst = (err - bound).max()
    assert worst <= 0, f"error exceeds the half-step bound by {worst.item()}"
    # saturated elements read back as exactly +-6 s
    s = (fmt.e4m3_decode(sf).double() * g).repeat_interleave(16, -1)
    sat = (x.double().abs() / s > 6.0 + 1e-6) & (s > 0)
    torch.testing.assert_close(deq[sat], (6 * s * x.double().sign())[sat], rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["random", "outliers", "tiny", "huge", "mixed_binades"])
def test_saturation_is_bounded_by_scale_rounding(kind, gen):
    """How far the block amax can exceed 6 * scale, per scale regime.

    sf = RNE_e4m3(amax / 6).  Normal sf below 448: relative rounding error <= 2^-4, so
    amax / sf <= 6 (1 + 2^-4) = 6.375.  Subnormal or zero sf: absolute error <= 2^-10 (half the
    subnormal spacing 2^-9), so amax - 6 sf <= 6 * 2^-10.  sf = 448: amax / 6 >= 432 (the tie
    between 416 and 448 goes to 448) and the excess is unbounded (saturation by design).
    """
    g = 1.0
    x = make_data(kind, gen)
    packed, sf = fmt.quantize(x, g)
    amax = x.double().unflatten(-1, (-1, 16)).abs().amax(-1)
    s = fmt.e4m3_decode(sf).double()
    normal = (sf >= 0x08) & (sf < 0x7E)
    sub = sf < 0x08
    assert (amax[normal] / s[normal] <= 6.375 * (1 + 1e-6)).all()
    assert (amax[sub] - 6 * s[sub] <= 6 * 2.0 ** -10 * (1 + 1e-6)).all()
    assert (amax[sf == 0x7E] / 6 >= 432 * (1 - 1e-6)).all()
    assert (sf <= 0x7E).all()
    if kind == "huge":
        assert (sf == 0x7E).any()
    if kind == "tiny":
        assert sub.any()


# ============================================================================ global scale policy
def test_calibrate_global_scale():
    assert fmt.calibrate_global_scale(2688.0) == 1.0
    assert fmt.calibrate_global_scale(0.0) == 1.0
    g = fmt.calibrate_global_scale(torch.tensor(37.5), headroom=1.25)
    assert g == pytest.approx(37.5 * 1.25 / 2688)
    assert fmt.representable_max(g) == pytest.approx(37.5 * 1.25)


@pytest.mark.parametrize("amax, headroom, name", [(math.nan, 1.0, "amax"), (math.inf, 1.0, "amax"),
                                                  (1.0, 0.0, "headroom"), (1.0, -2.0, "headroom")])
def test_calibrate_global_scale_rejects(amax, headroom, name):
    with pytest.raises(ValueError, match=name):
        fmt.calibrate_global_scale(amax, headroom)


def test_calibrated_scale_does_not_saturate(gen):
    x = make_data("outliers", gen)
    g = fmt.calibrate_global_scale(x.abs().max())
    deq = fmt.dequantize(*fmt.quantize(x, g), g, torch.float64)
    # the largest element lands on (or rounds to) the top code: no clipping beyond RNE of the scale
    assert deq.abs().max().item() == pytest.approx(x.abs().max().item(), rel=2.0 ** -4)


def test_e2m1_fast_rounding_matches_the_definition_on_every_float(tmp_path):
    """csrc/e2m1.h: the CUDA writer's bit-trick rounding onto E2M1 codes equals the threshold
    definition (format.py's rounding) for every non-NaN float of both signs, 4.28e9 of them, and its
    8-codes-per-word packing (e2m1_pack8) equals the codes one by one on 4e6 words of thresholds,
    zeros, infinities and random floats, and its block maximum over 6 (max_over_6: a product and an FMA
    correction) equals the division on every float in [0, 2^13]; run on the host from the same source
    the kernel includes."""
    import shutil
    import subprocess
    from pathlib import Path
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = Path(__file__).resolve().parent.parent
    exe = tmp_path / "e2m1_exhaustive"
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{root / 'csrc'}",
                    str(root / "tests" / "csrc" / "e2m1_exhaustive.cpp"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.startswith("ok: 4278190082 floats"), res.stdout + res.stderr
    assert "ok: 4000000 packed words" in res.stdout, res.stdout
    assert "ok: 1174405121 quotients" in res.stdout, res.stdout
