"""Accuracy modes inside the NVFP4 bytes: the 6-or-4 block maximum and the Hadamard rotation."""
from __future__ import annotations

import math

import pytest
import torch

from nvfp4_backend import format as fmt, ops, reference
from nvfp4_backend.layout import PagedKVCache
from nvfp4_backend.modes import KVMode


def _block_errors(x, packed, sf, g_scale=1.0):
    deq = fmt.dequantize(packed, sf, g_scale)
    return ((deq - x) ** 2).unflatten(-1, (-1, fmt.BLOCK_SIZE)).sum(-1)


def test_6or4_never_worse_and_picks_the_better_scale(gen):
    x = torch.randn(4000, 64, generator=gen) * torch.rand(4000, 1, generator=gen) * 20
    x[::7, 3] *= 30  # outliers
    p6, s6 = fmt.quantize(x, 0.01, "6")
    p64, s64 = fmt.quantize(x, 0.01, "6or4")
    e6, e64 = _block_errors(x, p6, s6, 0.01), _block_errors(x, p64, s64, 0.01)
    assert (e64 <= e6 * (1 + 1e-6) + 1e-12).all()
    changed = s64 != s6
    assert changed.any() and (~changed).any(), "both choices should occur on this data"
    # where the rule switched, the block's maximum now maps to (at most) 4 instead of 6
    # (for normal, unsaturated E4M3 scales, whose rounding is within 1/16)
    scaled_max = (x / 0.01).abs().unflatten(-1, (-1, 16)).amax(-1)
    normal = changed & (fmt.e4m3_decode(s64) >= 2.0 ** -6) & (fmt.e4m3_decode(s64) < fmt.E4M3_MAX)
    ratio = scaled_max[normal] / fmt.e4m3_decode(s64[normal])
    assert normal.any() and (ratio <= 4 * (1 + 1 / 16)).all() and (ratio >= 4 * (1 - 1 / 16)).all()


def test_6or4_tie_keeps_the_standard_scale():
    # a block whose maximum is exactly 6 x an E4M3 value and other elements exactly on the grid
    # reconstructs with zero error under both rules: the tie keeps the "6" scale
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, 3.0
    assert torch.equal(fmt.quantize(x, 1.0, "6or4")[1], fmt.quantize(x, 1.0, "6")[1])
    assert torch.equal(fmt.quantize(torch.zeros(2, 32), 1.0, "6or4")[1], torch.zeros(2, 2, dtype=torch.uint8))


def test_6or4_keeps_nan_blocks_marked():
    x = torch.ones(1, 32)
    x[0, 20] = float("nan")
    _, sf = fmt.quantize(x, 1.0, "6or4")
    assert sf[0, 1].item() == fmt.E4M3_NAN_BYTE and sf[0, 0].item() != fmt.E4M3_NAN_BYTE


def test_bad_modes_are_rejected():
    with pytest.raises(ValueError, match="scale_rule"):
        KVMode(scale_rule="5")
    with pytest.raises(ValueError, match="rotation"):
        KVMode(rotation="random")
    with pytest.raises(ValueError, match="scale_rule"):
        fmt.quantize(torch.zeros(1, 16), 1.0, "four")
    with pytest.raises(ValueError, match="power of two"):
        fmt.hadamard(96)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_hadamard_is_orthonormal_and_symmetric(d):
    h = fmt.hadamard(d, dtype=torch.float64)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_hadamard_transform_is_x_times_h_by_the_documented_butterflies(d, gen):
    """fmt.hadamard_transform (the writer's rotation) is x H up to fp32 rounding, its own inverse,
    and bit for bit the scalar butterfly loop its docstring defines (the CUDA writer's order)."""
    x = torch.randn(3, d, generator=gen) * torch.rand(3, 1, generator=gen) * 100
    y = fmt.hadamard_transform(x)
    exact = x.double() @ fmt.hadamard(d, dtype=torch.float64)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-5 * float(x.abs().max()))
    torch.testing.assert_close(fmt.hadamard_transform(y).double(), x.double(), rtol=0, atol=1e-5 * float(x.abs().max()))
    rows = []
    for row in x.tolist():
        v = [torch.tensor(e, dtype=torch.float32) for e in row]
        h = 1
        while h < d:
            for i in range(d):
                if not i & h:
                    v[i], v[i + h] = v[i] + v[i + h], v[i] - v[i + h]
            h *= 2
        rows.append(torch.stack(v) * torch.tensor(1 / math.sqrt(d), dtype=torch.float32))
    assert torch.equal(y, torch.stack(rows))
    with pytest.raises(ValueError, match="power of two"):
        fmt.hadamard_transform(torch.zeros(2, 96))


def test_rotation_is_exact_without_quantization(gen):
    """q.k = (qH).(kH) and P (V H) H = P V: attention over rotated dense K/V, with the query
    rotated and the output rotated back, equals the unrotated attention (fp64)."""
    b, L, hkv, grp, d = 2, 50, 2, 3, 64
    k = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, L, hkv, d, generator=gen, dtype=torch.float64)
    q = torch.randn(6, hkv * grp, d, generator=gen, dtype=torch.float64)
    seq = torch.tensor([50, 31])
    qsl = torch.tensor([0, 4, 6])
    h = fmt.hadamard(d, dtype=torch.float64)
    sinks = torch.randn(6, generator=gen)
    plain = reference.attention_ref(q, k, v, seq, qsl, 0.125, 20, 30.0, sinks, torch.float64)
    rot = reference.attention_ref(q @ h, k @ h, v @ h, seq, qsl, 0.125, 20, 30.0, sinks, torch.float64) @ h
    torch.testing.assert_close(rot, plain, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", [KVMode("6or4"), KVMode(rotation="hadamard"), KVMode("6or4", "hadamard")])
def test_ops_apply_the_cache_mode(mode, gen):
    """write_kv + paged_attention on a cache with a mode equal the reference built by hand: the
    pages hold quantize(k H) (or k) with the mode's scale rule, and the output is rotated back."""
    d, hkv, grp, ps = 64, 2, 4, 16
    seq_lens, q_lens = [40, 17], [2, 1]
    cache = PagedKVCache.allocate(8, ps, hkv, d, mode=mode)
    n = sum(seq_lens)
    key = (torch.randn(n, hkv, d, generator=gen) * 3).bfloat16()
    value = torch.randn(n, hkv, d, generator=gen).bfloat16()
    table = torch.tensor([[1, 2, 3], [5, 4, 0]], dtype=torch.int32)
    slots = torch.cat([torch.tensor([int(table[b, i // ps]) * ps + i % ps for i in range(s)])
                       for b, s in enumerate(seq_lens)])
    ops.write_kv(key, value, slots, cache, 0.5, 0.25)
    h = fmt.hadamard(d) if mode.rotation == "hadamard" else torch.eye(d)
    want_k, want_ks = fmt.quantize(fmt.hadamard_transform(key).bfloat16() if mode.rotation == "hadamard" else key, 0.5,
                                   mode.scale_rule)
    pages, offs = slots // ps, slots % ps
    assert torch.equal(cache.k_data[pages, offs], want_k) and torch.equal(cache.k_block_scales[pages, offs], want_ks)

    q = torch.randn(sum(q_lens), hkv * grp, d, generator=gen).bfloat16()
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.paged_attention(q, cache, table, sl, qsl, 0.5, 0.25, 1 / math.sqrt(d))
    plain = PagedKVCache(*cache.tensors())
    ref = reference.paged_attention_ref((q.float() @ h).bfloat16() if mode.rotation == "hadamard" else q, plain, table,
                                        sl, qsl, torch.tensor(0.5), torch.tensor(0.25), 1 / math.sqrt(d))
    ref = (ref.bfloat16().float() @ h) if mode.rotation == "hadamard" else ref
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["plain", "6or4", "hadamard", "hadamard-6or4"])
def test_mode_names_round_trip(name):
    assert KVMode.from_name(name).name == name


def test_configured_mode_reads_the_environment(monkeypatch):
    from nvfp4_backend.modes import DEFAULT_KV_MODE, KV_MODE_ENV, configured_kv_mode
    monkeypatch.delenv(KV_MODE_ENV, raising=False)
    assert configured_kv_mode() == KVMode.from_name(DEFAULT_KV_MODE)
    monkeypatch.setenv(KV_MODE_ENV, " hadamard-6or4 ")
    assert configured_kv_mode() == KVMode("6or4", "hadamard")
    monkeypatch.setenv(KV_MODE_ENV, "6or4-hadamard")
    with pytest.raises(ValueError, match=r"\$NVFP4_BACKEND_KV_MODE: KV mode must be one of"):
        configured_kv_mode()


def test_constructors_carry_the_mode():
    mode = KVMode("6or4", "hadamard")
    pages = torch.zeros(3, 2 * 16 * 2 * fmt.bytes_per_token_head(64), dtype=torch.uint8)
    assert PagedKVCache.from_inline_pages(pages, 16, 2, 64, head_major=True, mode=mode).mode == mode
    rows = [torch.zeros(32, 2, n, dtype=torch.uint8) for n in (32, 4, 32, 4)]
    assert PagedKVCache.from_token_rows(*rows, page_size=16, mode=mode).mode == mode


def test_rotated_mode_leaves_rows_past_the_batch_untouched(gen):
    """As without rotation: query rows past query_start_loc[-1] (graph padding) are not written."""
    d, hkv, ps = 64, 1, 16
    cache = PagedKVCache.allocate(4, ps, hkv, d, mode=KVMode(rotation="hadamard"))
    key = torch.randn(20, hkv, d, generator=gen).bfloat16()
    ops.write_kv(key, key, torch.arange(16, 36), cache, 1.0, 1.0)
    q = torch.randn(3, 2, d, generator=gen).bfloat16()  # 1 real row, 2 padding rows
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(q, cache, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                        torch.tensor([0, 1], dtype=torch.int32), 1.0, 1.0, 0.125, out=out)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1:]).all()
