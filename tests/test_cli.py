"""``nvfp4-backend eval | demo | info`` end to end on the embedded model, short settings, in-process
(the model is loaded once per process and shared)."""
from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from nvfp4_backend.tools.cli import main  # noqa: E402


def test_eval_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--tokens", "256", "--window", "128", "--calib-tokens", "128", "--prompts", "2",
               "--gen-tokens", "4", "--formats", "nvfp4", "nvfp4-amax", "fp8", "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "nvfp4-backend-eval/1"
    assert data["settings"]["formats"] == ["bf16", "nvfp4", "nvfp4-amax", "fp8"]
    assert data["settings"]["windows"] == 2 and data["settings"]["tokens"] == 256
    assert data["model"]["layers"] == 30 and data["model"]["head_dim"] == 64
    assert data["text"]["name"] == "stdlib-docstring-prose" and len(data["text"]["sha256"]) == 64
    res = data["results"]
    base = res["bf16"]
    assert base["kl_vs_bf16"] == 0 and base["top1_agreement_vs_bf16"] == 1 and base["perplexity_change_pct"] == 0
    assert base["greedy_exact_match_vs_bf16"] == 1
    for f, r in res.items():
        assert math.isfinite(r["perplexity"]) and 1 < r["perplexity"] < 1000
        assert r["scored_tokens"] == 2 * 127
        assert 0 <= r["top1_agreement_vs_bf16"] <= 1 and r["kl_vs_bf16"] >= 0
    assert res["nvfp4"]["kv_bytes_per_token"] == 6480 and res["fp8"]["kv_bytes_per_token"] == 11520
    assert res["nvfp4"]["kl_vs_bf16"] > res["fp8"]["kl_vs_bf16"] > 0
    assert len(res["nvfp4-amax"]["kv_scales"]) == 30
    assert len(data["generations"]["nvfp4"]) == 2 and all(len(g["tokens"]) <= 4 for g in data["generations"]["nvfp4"])
    printed = capsys.readouterr().out
    assert "nvfp4-amax" in printed and "perplexity" in printed


def test_eval_fake_quant_check_column(tmp_path):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--tokens", "128", "--window", "128", "--prompts", "0", "--formats", "nvfp4",
               "--fake-quant-check", "--no-progress", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"]
    assert set(r) == {"bf16", "nvfp4"}
    assert abs(r["nvfp4"]["real_vs_fake_quant_pct"]) < 10
    assert abs(r["bf16"]["real_vs_fake_quant_pct"]) < 1


@pytest.mark.parametrize("argv, name", [
    (["--window", "0"], "--window"),
    (["--tokens", "64", "--window", "128"], "--tokens"),
    (["--formats", "int3"], "--formats"),
    (["--prompts", "99"], "--prompts"),
    (["--text-file", "/nonexistent/text.txt"], "--text-file"),
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["--out", "/nonexistent/dir/x.json"], "--out"),
])
def test_eval_errors_name_the_argument(argv, name, capsys):
    assert main(["eval", "--no-progress", *argv]) == 2
    assert name in capsys.readouterr().err


def test_demo_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--prompts", "2", "--max-new-tokens", "6", "--eval-tokens", "128", "--eval-window", "128",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "nvfp4-backend-demo/1"
    assert len(data["generations"]) == 2
    for g in data["generations"]:
        assert g["bf16"] and g["nvfp4"] and isinstance(g["identical"], bool)
    assert data["kv_bytes_per_token"] == {"bf16": 23040, "fp8": 11520, "nvfp4": 6480}
    assert {r["model"] for r in data["capacity"]} == {"Llama-3.1-8B", "Qwen3-32B", "Llama-3.1-70B"}
    assert set(data["eval"]["results"]) == {"bf16", "fp8", "nvfp4", "nvfp4-6or4"}
    printed = capsys.readouterr().out
    assert "NVFP4 KV" in printed and "6,480" in printed


def test_demo_errors_name_the_argument(capsys):
    assert main(["demo", "--prompts", "0"]) == 2
    assert "--prompts" in capsys.readouterr().err


def test_info_shows_capacity(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rows = info["kv capacity"]
    assert [r["model"] for r in rows] == ["Llama-3.1-8B", "Qwen3-32B", "Llama-3.1-70B"]
    assert all(r["nvfp4_tokens"] > r["fp8_tokens"] > r["bf16_tokens"] > 0 for r in rows)


def test_info_names_the_prefill_path(capsys, monkeypatch):
    from nvfp4_backend.tools import cli
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prefill"] == "the PyTorch reference"  # this machine: no GPU
    # on a GPU with the kernels: the dense path where it can run, else the kernel and the dense path's reason
    monkeypatch.setattr("nvfp4_backend.dense_prefill.unavailable_reason", lambda device: None)
    assert cli._prefill_path("cuda").startswith("eager calls: the dense path")
    monkeypatch.setattr("nvfp4_backend.dense_prefill.unavailable_reason", lambda device: "FlashInfer is not installed")
    assert cli._prefill_path("cuda") == "the prefill kernel (the dense path is off: FlashInfer is not installed)"


def test_info_reports_the_kv_mode(capsys, monkeypatch):
    monkeypatch.setenv("NVFP4_BACKEND_KV_MODE", "hadamard-6or4")
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv mode"].startswith("hadamard-6or4 ")
    monkeypatch.setenv("NVFP4_BACKEND_KV_MODE", "rotate")
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv mode"].startswith("invalid: $NVFP4_BACKEND_KV_MODE")
