"""The randomized differential tester (``nvfp4-backend fuzz``) on the CPU: its generator, its CLI,
and that it catches wrong results.  On a GPU the same harness runs the CUDA kernels
(tests/gpu/test_decode.py runs a fixed-seed subset; docs/performance.md cites the 1000-configuration runs)."""
from __future__ import annotations

import json

import pytest
import torch

from nvfp4_backend.capabilities import decode_max_rows
from nvfp4_backend.tools import fuzz
from nvfp4_backend.tools.cli import main

CPU = torch.device("cpu")


@pytest.mark.parametrize("seed", range(0, 400, 7))
def test_generated_configurations_are_valid_and_replayable(seed):
    cfg = fuzz.generate(seed, max_context=262144)
    assert cfg == fuzz.generate(seed, max_context=262144)
    assert len(cfg.seq_lens) == len(cfg.q_lens) >= 1
    assert all(0 <= q <= s for s, q in zip(cfg.seq_lens, cfg.q_lens))
    assert cfg.q_lens[0] >= 1 and max(cfg.seq_lens) <= 262144 + 2 * decode_max_rows(cfg.head_dim)
    assert sum(cfg.seq_lens) * cfg.num_kv_heads * cfg.head_dim <= 2 * (1 << 28)
    assert cfg.page_size & (cfg.page_size - 1) == 0 and 1e-4 <= cfg.k_scale <= 1e3


def test_cli_runs_and_records(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert main(["fuzz", "--configs", "8", "--seed", "1000", "--max-context", "48", "--device", "cpu",
                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["failures"] == 0 and len(run["records"]) == 8 and run["meta"]["first_seed"] == 1000
    assert all(r["ok"] and r["rel_err"] < fuzz.TOLERANCE and r["bound_used"] <= 1 for r in run["records"])
    assert "8 configurations, 0 failures" in capsys.readouterr().out


def test_time_limit_stops_early_and_records_what_ran(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    assert main(["fuzz", "--configs", "50", "--seed", "7", "--max-context", "48", "--device", "cpu",
                 "--time-limit", "0", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["meta"]["configs"] == len(run["records"]) == 1 and run["meta"]["requested"] == 50
    assert "time limit 0 s reached after 1 configurations" in capsys.readouterr().out


SMALL = dict(max_context=40)


def _find_seed(pred):
    return next(s for s in range(1000) if pred(fuzz.generate(s, **SMALL)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("max_context", [40, 4096])
def test_catches_a_wrong_attention_result(monkeypatch, dtype, max_context):
    """A 1 % error fails, in fp16 too: the fp16 subnormal-weight allowance cannot absorb it."""
    real = fuzz.ops.paged_attention

    def off_by_one_percent(*args, out, **kw):
        real(*args, out=out, **kw)
        out.mul_(1.01)
        return out

    draw = lambda s: fuzz.generate(s, max_context, max_elements=1 << 20)  # noqa: E731
    # no window: a window of 1 can leave a query only its own token, whose V may round to all zeros
    cfg = next(c for c in map(draw, range(1000)) if c.dtype == dtype and c.sliding_window is None
               and max(c.seq_lens) > max_context // 4)
    assert fuzz.run_config(cfg, CPU)["ok"]
    monkeypatch.setattr(fuzz.ops, "paged_attention", off_by_one_percent)
    rec = fuzz.run_config(cfg, CPU)
    assert not rec["ok"] and "relative L2 error" in rec["failure"]


DENSE = dict(max_context=300, max_elements=1 << 20)


def test_draws_the_dense_prefill_in_one_pass_and_in_several():
    """Extends draw the dense prefill (on the CPU its dequantize and fp64 kernel), and small
    workspaces make it merge several passes; a replay draws the same."""
    dense = [c for c in map(lambda s: fuzz.generate(s, **DENSE), range(400)) if c.dense]
    assert dense and all(max(c.q_lens) > fuzz.capabilities.decode_query_len(c.group, c.head_dim) for c in dense)
    paths = {}
    for cfg in dense[:12] + [c for c in dense if c.dense_rows is not None][:6]:
        rec = fuzz.run_config(cfg, CPU)
        assert rec["ok"], rec
        paths[cfg.seed] = rec["path"]
    assert any(p.startswith("reference+dense(1 passes)") for p in paths.values())
    assert any("dense(" in p and not p.endswith("(1 passes)") for p in paths.values()), paths


def test_the_record_names_the_kernels_ops_runs_on_a_gpu():
    """The GPU path label follows ops: a dense plan takes the long requests (the prefill kernel does
    not run), the decode kernel only where short requests remain; without one, the prefill kernel
    takes what the decode kernel cannot hold."""
    from nvfp4_backend import planner
    from nvfp4_backend.layout import PagedKVCache
    gpu, cache = torch.device("cuda"), PagedKVCache.allocate(4, 16, 2, 64, "HND", "cpu")
    cfg = fuzz.generate(1, **DENSE)
    cfg.q_lens, cfg.seq_lens, cfg.group, cfg.num_kv_heads, cfg.head_dim = [1, 40], [30, 40], 4, 2, 64
    base = planner.plan_attention(2, 2, 4, 40, 40, 64)
    assert fuzz._path(cfg, base, cache, gpu) == "decode+prefill"
    assert fuzz._path(cfg, fuzz._dense_plan(cfg, base, CPU, torch.bfloat16), cache, gpu) == "decode+dense(1 passes)"
    cfg.q_lens, cfg.seq_lens = [40, 20], [40, 30]
    assert fuzz._path(cfg, fuzz._dense_plan(cfg, base, CPU, torch.bfloat16), cache, gpu) == "dense(1 passes)"
    cfg.q_lens = [1, 1]
    assert fuzz._path(cfg, planner.plan_attention(2, 2, 4, 1, 40, 64), cache, gpu) == "decode"
    odd = PagedKVCache.allocate(4, 12, 2, 64, "HND", "cpu")  # page size not a power of two
    assert fuzz._path(cfg, base, odd, gpu) == "prefill"


def test_catches_a_wrong_dense_prefill_result(monkeypatch):
    """The dense path's output is what the fuzz checks: 1 % off on its rows fails."""
    real = fuzz.dense_prefill.run

    def off_by_one_percent(plan, out, *args):
        real(plan, out, *args)
        out[plan.first_row:plan.last_row].mul_(1.01)

    cfg = next(c for c in map(lambda s: fuzz.generate(s, **DENSE), range(400))
               if c.dense and c.sliding_window is None and c.dtype == "float16")
    assert "dense" in fuzz.run_config(cfg, CPU)["path"]
    monkeypatch.setattr(fuzz.dense_prefill, "run", off_by_one_percent)
    rec = fuzz.run_config(cfg, CPU)
    assert not rec["ok"] and "relative L2 error" in rec["failure"]


def test_fp16_weight_allowance_rejects_flushing_a_weight_the_kernel_keeps():
    """Seed 22 (an H200 failure before the weights were biased by 2^15): all weight on a zero-V
    token, a context weight of 2^-32.7.  Unbiased fp16 weights flushed it and returned 0 where the
    exact output is up to ~4e-7; biased, the weight is an fp16 subnormal that keeps 7 bits, so
    the fuzz bound (which allows only weights below 2^-40 to vanish) must fail that output."""
    real = fuzz.ops.paged_attention

    def fp16_weights_flushed(q, cache, table, seq, qsl, kg, vg, scale, *, out, **kw):
        real(q, cache, table, seq, qsl, kg, vg, scale, out=out, **kw)
        out[1].zero_()  # request 1: exactly what the kernel returned on the H200
        return out

    cfg = fuzz.generate(22, 262144)
    assert cfg.dtype == "float16" and cfg.seq_lens[1] == 2 and cfg.q_lens[1] == 1
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(fuzz.ops, "paged_attention", fp16_weights_flushed)
    try:
        rec = fuzz.run_config(cfg, CPU)
        assert not rec["ok"] and "relative L2 error" in rec["failure"]
    finally:
        monkeypatch.undo()


def test_catches_writes_past_the_batch(monkeypatch):
    real = fuzz.ops.paged_attention

    def writes_padding(*args, out, **kw):
        real(*args, out=out, **kw)
        out[-1].zero_()
        return out

    monkeypatch.setattr(fuzz.ops, "paged_attention", writes_padding)
    rec = fuzz.run_config(fuzz.generate(_find_seed(lambda c: c.pad_rows > 0), **SMALL), CPU)
    assert not rec["ok"] and "rows past the batch" in rec["failure"]


def test_catches_a_wrong_cache_byte(monkeypatch):
    real = fuzz.ops.write_kv

    def flips_a_scale(key, value, slots, cache, kg, vg):
        real(key, value, slots, cache, kg, vg)
        s = int(slots[0])
        cache.v_block_scales[s // cache.page_size, s % cache.page_size, 0, 0] ^= 1

    monkeypatch.setattr(fuzz.ops, "write_kv", flips_a_scale)
    rec = fuzz.run_config(fuzz.generate(5, **SMALL), CPU)
    assert not rec["ok"] and rec["failure"].startswith("write_kv: 1 bytes of v_block_scales")


def test_catches_leaked_stale_bytes(monkeypatch):
    """Every slot no request owns holds NaN scales: an op that reads past seq_len shows it."""
    real = fuzz.ops.paged_attention

    def reads_one_past_the_end(q, cache, table, seq_lens, *args, **kw):
        return real(q, cache, table, seq_lens + 1, *args, **kw)

    monkeypatch.setattr(fuzz.ops, "paged_attention", reads_one_past_the_end)
    seed = _find_seed(lambda c: c.q_lens[0] == 1 and c.seq_lens[0] % c.page_size and c.sliding_window is None)
    rec = fuzz.run_config(fuzz.generate(seed, **SMALL), CPU)
    assert not rec["ok"] and "non-finite" in rec["failure"]
