"""``nvfp4-backend bench --zoo`` without a GPU: its arguments, its table of model shapes, and the
report (JSON, printed table, plot) it writes from timed rows, fed here with made-up timings."""
from __future__ import annotations

import argparse
import builtins
import json
import math

import pytest

from nvfp4_backend import capabilities
from nvfp4_backend.tools import bench, bench_zoo, timing
from nvfp4_backend.tools.bench_zoo import (PAGE_SIZE, ZOO, ZooRow, row_args, select_rows, summarize, write_report,
                                           zoo_table)
from nvfp4_backend.tools.cli import main


def parse(argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_zoo_flag_parses_and_excludes_the_other_tasks():
    assert parse(["--zoo", "--out", "z.json"]).zoo and not parse([]).zoo
    for other in (["--step"], ["--prefill", "1x0x128"]):
        with pytest.raises(SystemExit):
            parse(["--zoo", *other])


def test_bench_zoo_dispatches_to_run_zoo(monkeypatch):
    called = {}
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench.torch, "Generator", lambda device: argparse.Namespace(manual_seed=lambda s: None))
    monkeypatch.setattr(bench_zoo, "run_zoo", lambda *a: called.setdefault("zoo", a) and 7)
    assert main(["bench", "--zoo", "--no-peers", "--zoo-rows", "D64", "--out", "x.json", "--plot", "x.png"]) == 7
    args, device, gen, fi, ws = called["zoo"]
    assert args.zoo and args.zoo_rows == "D64" and (args.out, args.plot) == ("x.json", "x.png")
    assert str(device) == "cuda:0" and fi is None and ws is None


def test_bench_zoo_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--zoo"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_zoo_is_the_issues_table():
    shapes = {}
    for r in ZOO:
        shapes.setdefault((r.models, r.q_heads, r.kv_heads, r.head_dim), []).append((r.batch, r.seq_len))
    assert shapes == {
        ("Llama-3.1-8B", 32, 8, 128): [(64, 8192)],
        ("Llama-3.1-70B, Qwen3-32B", 64, 8, 128): [(32, 8192), (1, 131072)],
        ("Qwen2.5-7B", 28, 4, 128): [(64, 8192), (1, 131072)],
        ("Llama-3.1-405B", 128, 8, 128): [(32, 8192), (1, 131072)],
        ("gpt-oss", 64, 8, 64): [(64, 8192), (8, 65536)],
        ("Gemma-2-9B", 16, 8, 256): [(32, 8192), (1, 131072)],
    }
    assert [(r.q_heads, r.kv_heads, r.head_dim, r.batch, r.seq_len) for r in ZOO if r.hadamard] == [(32, 8, 128, 64, 8192)]
    assert PAGE_SIZE == 16 and len(set(ZOO)) == len(ZOO)


@pytest.mark.parametrize("row", ZOO, ids=lambda r: r.label)
def test_every_zoo_row_runs_on_the_decode_kernel(row):
    assert row.q_heads % row.kv_heads == 0
    assert row.head_dim in capabilities.SUPPORTED_HEAD_DIMS
    spec = parse([]).spec_q_len
    for q_len in (1, spec):  # both columns are decodes, not prefill-kernel extends
        assert capabilities.decode_supports(row.group_size, q_len, row.head_dim), (row.label, q_len)
    with pytest.raises(Exception):
        ZooRow("x", 1, 1, 64, 1, 1).models = "y"  # frozen


def test_select_rows_by_index_and_label():
    labels = lambda sel: [i for i, _ in sel]
    assert select_rows(None) == select_rows("") == select_rows("all") == list(enumerate(ZOO))
    assert labels(select_rows("3,0")) == [0, 3]  # the zoo's order, whatever the option's
    assert labels(select_rows("D64")) == [7, 8] and labels(select_rows("d256")) == [9, 10]
    assert labels(select_rows("1x131072")) == [2, 4, 6, 10]
    assert labels(select_rows("gemma, 0,D256")) == [0, 9, 10]  # spaces, and rows named twice, once
    assert [r for _, r in select_rows("Qwen2.5")] == [ZOO[3], ZOO[4]]
    for bad in ("11", "99", "D96", "0,nope", ","):
        with pytest.raises(ValueError, match="--zoo-rows"):
            select_rows(bad)


def test_zoo_rows_errors_come_before_the_gpu(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: pytest.fail("looked for a GPU"))
    assert main(["bench", "--zoo", "--zoo-rows", "D96"]) == 2
    err = capsys.readouterr().err
    assert "'D96' is in no row's label" in err and ZOO[-1].label in err and " 10  " in err
    assert main(["bench", "--zoo-rows", "0"]) == 2
    assert "--zoo-rows needs --zoo" in capsys.readouterr().err


def test_row_args_take_the_rows_shape_and_modes():
    args = parse(["--zoo", "--q-heads", "7", "--modes", "6or4", "--iters", "3", "--layout", "NHD"])
    had, plain = row_args(args, ZOO[0]), row_args(args, ZOO[-1])
    assert (had.q_heads, had.kv_heads, had.head_dim, had.modes, had.iters) == (32, 8, 128, "plain,hadamard", 3)
    assert (plain.q_heads, plain.kv_heads, plain.head_dim, plain.modes) == (16, 8, 256, "plain")
    assert had.layout == plain.layout == "HND"
    assert args.q_heads == 7 and args.modes == "6or4" and args.layout == "NHD"  # the command line's own stay


def fake_rows():
    """What run_zoo collects for two zoo rows, with made-up timings: bench_case's rows and the zoo's
    fields.  The second row ran no hadamard, no FP8 peer, no spec."""
    def row(zoo, impl, kv, us, q_len=1, **kw):
        return dict(B=zoo.batch, L=zoo.seq_len, page_size=PAGE_SIZE, impl=impl, kv=kv, q_len=q_len, us=us,
                    tbps=10 / us, us_b2b=us - 1, tbps_b2b=10 / (us - 1), zoo_index=ZOO.index(zoo),
                    models=zoo.models, q_heads=zoo.q_heads, kv_heads=zoo.kv_heads, head_dim=zoo.head_dim, **kw)
    a, b = ZOO[0], ZOO[-1]
    return [
        row(a, "nvfp4-backend", "nvfp4", 101, rel_err=1.6e-3, splits=1, heads_per_block=4, fused=True),
        row(a, "nvfp4-backend", "nvfp4", 131, q_len=4, rel_err=1.7e-3, splits=1, heads_per_block=1, fused=True),
        row(a, "nvfp4-backend", "nvfp4", 106, mode="hadamard", rel_err=1.6e-3, splits=1, heads_per_block=4, fused=True),
        row(a, "flashinfer-fa2", "bf16", 301),
        row(a, "flashinfer-fa2", "fp8", 201),
        row(a, "flashinfer-fa2", "nvfp4", 401, rel_err=3e-3),
        row(b, "nvfp4-backend", "nvfp4", 51, rel_err=1.5e-3, splits=16, heads_per_block=1, fused=False),
        row(b, "flashinfer-fa2", "bf16", 151),
    ]


def test_report_json_schema(tmp_path, monkeypatch):
    plotted = []
    monkeypatch.setattr(bench_zoo, "zoo_plot", lambda summary, meta, path: plotted.append(path) or True)
    out = tmp_path / "zoo.json"
    meta = dict(gpu="fake", copy_tbps=4.3, page_size=PAGE_SIZE)
    returned = write_report(fake_rows(), meta, out)
    assert plotted == []  # no plot path: the JSON only (as after each row of a run)
    data = json.loads(out.read_text())
    assert set(data) == {"schema", "meta", "zoo", "decode"} and data["schema"] == "nvfp4-backend-bench-zoo/1"
    assert data["meta"] == meta and data["decode"] == fake_rows() and data["zoo"] == returned
    a, b = data["zoo"]
    assert (a["index"], a["label"], a["models"], a["q_heads"], a["kv_heads"], a["head_dim"], a["B"], a["L"],
            a["page_size"]) == (0, ZOO[0].label, "Llama-3.1-8B", 32, 8, 128, 64, 8192, 16)
    assert a["ours"] == dict(us=101, tbps=10 / 101, us_b2b=100, tbps_b2b=0.1, rel_err=1.6e-3, splits=1,
                             heads_per_block=4, fused=True)
    assert a["spec"] == dict(q_len=4, us=131, tbps=10 / 131, us_b2b=130, tbps_b2b=10 / 130, vs_q1=131 / 101,
                             vs_q1_b2b=1.3)
    assert a["peers"]["bf16"] == dict(us=301, tbps=10 / 301, us_b2b=300, tbps_b2b=10 / 300)
    assert a["x_peer"] == dict(bf16=3.0, fp8=2.0, nvfp4=4.0)
    assert a["hadamard"] == dict(us=106, tbps=10 / 106, us_b2b=105, tbps_b2b=10 / 105, vs_plain=106 / 101,
                                 vs_plain_b2b=1.05)
    assert b["index"] == len(ZOO) - 1 and b["models"] == "Gemma-2-9B" and (b["B"], b["L"]) == (1, 131072)
    assert b["spec"] is None and b["hadamard"] is None
    assert b["peers"]["fp8"] is None and b["peers"]["nvfp4"] is None and b["x_peer"]["bf16"] == 3.0
    assert b["x_peer"]["fp8"] is None
    write_report(fake_rows(), meta, out, tmp_path / "zoo_plot.png")
    assert plotted == [tmp_path / "zoo_plot.png"]


def test_table_shows_each_column():
    summary = summarize(fake_rows())
    b2b = zoo_table(summary, copy=0.2).splitlines()
    assert len(b2b) == 3 and "q4/q1" in b2b[0] and "hadamard" in b2b[0]
    cells = b2b[1].split()
    assert cells[0] == "0" and b2b[2].split()[0] == str(len(ZOO) - 1)  # the zoo index leads each row
    assert "100.0" in cells and "130.0" in cells and "1.30" in cells and "300.0" in cells and "4.00" in cells
    assert "3.00" in cells and "105.0" in cells and "1.05" in cells and "50%" in cells  # 0.1 TB/s of 0.2
    assert b2b[2].split().count("-") == 8  # no spec, fp8, nvfp4, hadamard (2 columns each): dashes
    isolated = zoo_table(summary, copy=0.2, us="us").splitlines()[1].split()
    assert "101.0" in isolated and "131.0" in isolated and f"{131 / 101:.2f}" in isolated
    assert "q8 us" in zoo_table([{**summary[0], "spec": {**summary[0]["spec"], "q_len": 8}}], 0.2)


def test_plot_is_skipped_cleanly_without_matplotlib(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out, png = tmp_path / "zoo.json", tmp_path / "zoo.png"
    write_report(fake_rows(), dict(gpu="fake", copy_tbps=4.3), out, png)
    printed = capsys.readouterr().out.strip().splitlines()
    assert out.exists() and not png.exists()
    assert len(printed) == 1 and printed[0].startswith("plot skipped") and "zoo.png" in printed[0]


def test_plot_is_written_to_its_path(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "zoo.png"
    png.parent.mkdir()
    write_report(fake_rows(), dict(gpu="fake", copy_tbps=4.3), tmp_path / "zoo.json", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_run_zoo_on_fake_timings(tmp_path, monkeypatch, capsys):
    """run_zoo end to end with bench_case, the copy and the GPU name faked: each selected row gets its
    own shape, the failing row is reported and skipped, the JSON is rewritten after each row."""
    by_index = {(r.q_heads, r.kv_heads, r.head_dim, r.batch, r.seq_len): i for i, r in enumerate(ZOO)}
    seen, snapshots = [], []
    out, png = tmp_path / "zoo.json", tmp_path / "zoo.png"
    real_fake = {(r["zoo_index"], r["impl"], r["kv"], r["q_len"], r.get("mode")): r for r in fake_rows()}

    def fake_case(B, L, ps, args, device, gen, fi, ws):
        i = by_index[(args.q_heads, args.kv_heads, args.head_dim, B, L)]
        seen.append((i, ps, args.layout, args.modes))
        snapshots.append(json.loads(out.read_text())["meta"]["zoo_rows"] if out.exists() else None)
        if i == 3:
            raise RuntimeError("CUDA out of memory")
        keep = ("B", "L", "page_size", "impl", "kv", "q_len", "us", "tbps", "us_b2b", "tbps_b2b", "mode", "rel_err")
        mine = [{k: v for k, v in r.items() if k in keep} for (j, *_), r in real_fake.items() if j == min(i, 10)]
        return [{**r, "B": B, "L": L} for r in mine]

    monkeypatch.setattr(bench, "bench_case", fake_case)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device: "Fake H200")
    monkeypatch.setattr(timing, "copy_bandwidth", lambda device: 0.2)
    args = parse(["--zoo", "--zoo-rows", "Gemma-2-9B 16/8 D256 1x,3,0", "--out", str(out), "--plot", str(png)])
    assert bench_zoo.run_zoo(args, "cuda:0", None, None, None) == 1  # row 3 failed
    assert seen == [(0, 16, "HND", "plain,hadamard"), (3, 16, "HND", "plain"), (10, 16, "HND", "plain")]
    assert snapshots[0] is None and snapshots[2] == [0, 3, 10]  # written after row 0, before row 10 ran
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["gpu"] == "Fake H200" and meta["copy_tbps"] == 0.2 and meta["layout"] == "HND"
    assert meta["page_size"] == 16 and meta["spec_q_len"] == 4 and "q_heads" not in meta
    assert list(meta["failed"]) == ["3"] and "out of memory" in meta["failed"]["3"]
    assert sorted(meta["row_seconds"]) == ["0", "10", "3"]
    assert [z["index"] for z in data["zoo"]] == [0, 10] and data["zoo"][1]["x_peer"]["bf16"] == 3.0
    assert png.read_bytes()[:4] == b"\x89PNG" if _has_matplotlib() else not png.exists()
    printed = capsys.readouterr()
    assert "row 3 failed: RuntimeError: CUDA out of memory" in printed.err
    isolated, b2b = printed.out.split("\nisolated replays")[1].split("back-to-back replays")
    for table in (isolated, b2b):  # the measured rows only
        assert ZOO[0].models in table and ZOO[10].models in table and ZOO[3].models not in table


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False
