"""Entry-point discovery, registration and the CLI / engine-args path to the backend class."""
from __future__ import annotations

import importlib.metadata
import os
import pickle
import subprocess
import sys

import pytest
import vllm.plugins
from vllm.v1.attention.backends import registry
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import nvfp4_vllm
from nvfp4_vllm.backend import Nvfp4XqaBackend


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "nvfp4_xqa"]
    assert len(ours) == 1, f"nvfp4_xqa entry point missing from {[ep.name for ep in eps]}"
    assert ours[0].value == "nvfp4_vllm:register"


def test_load_general_plugins_registers_backend(monkeypatch):
    calls = []
    real = nvfp4_vllm.register
    monkeypatch.setattr(nvfp4_vllm, "register", lambda: (calls.append(1), real())[1])
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # vLLM loads once per process
    AttentionBackendEnum.CUSTOM.clear_override()                 # prove the plugin sets it again
    vllm.plugins.load_general_plugins()
    assert calls == [1]
    assert AttentionBackendEnum.CUSTOM.get_class() is Nvfp4XqaBackend
    assert AttentionBackendEnum["NVFP4_XQA"].get_class() is Nvfp4XqaBackend


def test_nvfp4_xqa_is_another_name_of_custom():
    # So a config selecting it holds (and pickles as) the static CUSTOM member.
    assert AttentionBackendEnum["NVFP4_XQA"] is AttentionBackendEnum.CUSTOM
    assert pickle.loads(pickle.dumps(AttentionBackendEnum["NVFP4_XQA"])) is AttentionBackendEnum.CUSTOM


def run_python(code: str, stdin: bytes = b"", **env) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter: a process where no plugin has run yet."""
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, timeout=300,
                          env={**os.environ, **env})


def test_nvfp4_xqa_config_unpickles_in_a_process_without_plugins():
    # What a spawned engine core or worker does first: unpickle its config, before it loads
    # plugins (VLLM_PLUGINS="" loads none at all).  A member added at run time would not exist there.
    from vllm.config import AttentionConfig
    config = pickle.dumps(AttentionConfig(backend="nvfp4_xqa"))
    child = run_python("import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).backend.name)",
                       stdin=config, VLLM_PLUGINS="")
    assert child.returncode == 0, child.stderr.decode()[-3000:]
    assert child.stdout.decode().split() == ["CUSTOM"]


def test_register_is_idempotent():
    before = list(AttentionBackendEnum.__members__)
    for _ in range(3):
        nvfp4_vllm.register()
    assert list(AttentionBackendEnum.__members__) == before
    assert AttentionBackendEnum.CUSTOM.get_class() is Nvfp4XqaBackend


def test_backend_name_is_its_enum_member():
    # vLLM's Attention layer does AttentionBackendEnum[backend.get_name()].
    assert AttentionBackendEnum[Nvfp4XqaBackend.get_name()].get_class() is Nvfp4XqaBackend


def test_register_fails_loudly_on_incompatible_vllm(monkeypatch):
    from vllm.v1.attention.backends import utils
    monkeypatch.delattr(utils, "split_decodes_and_prefills")
    with pytest.raises(nvfp4_vllm.IncompatibleVllmError, match="split_decodes_and_prefills"):
        nvfp4_vllm.register()


def test_register_refuses_name_taken_by_another_class(monkeypatch):
    # CUSTOM (which NVFP4_XQA names) re-registered to another class after this plugin took it.
    monkeypatch.setitem(registry._ATTN_OVERRIDES, AttentionBackendEnum["NVFP4_XQA"], "other.pkg.Backend")
    with pytest.raises(nvfp4_vllm.IncompatibleVllmError, match="other.pkg.Backend"):
        nvfp4_vllm.register()


def test_register_refuses_nvfp4_xqa_registered_first_by_another_plugin():
    child = run_python(
        "from vllm.v1.attention.backends.registry import register_backend\n"
        "register_backend('NVFP4_XQA', 'other.pkg.Backend')\n"
        "import nvfp4_vllm; nvfp4_vllm.register()")
    assert child.returncode != 0
    assert "NVFP4_XQA is already registered to other.pkg.Backend" in child.stderr.decode()


def test_register_leaves_custom_owned_by_another_plugin():
    # A fresh process, so that CUSTOM is another plugin's before this one first registers.
    child = run_python(
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, register_backend\n"
        "register_backend(E.CUSTOM, 'other.pkg.Backend')\n"
        "import nvfp4_vllm; nvfp4_vllm.register()\n"
        "print('RESULT', E.CUSTOM.get_path(), E['NVFP4_XQA'].get_path(), E['NVFP4_XQA'] is E.CUSTOM)")
    out = child.stdout.decode() + child.stderr.decode()
    assert child.returncode == 0, out[-3000:]
    assert f"RESULT other.pkg.Backend {nvfp4_vllm.BACKEND_CLASS_PATH} False" in out
    assert "CUSTOM is already registered to other.pkg.Backend; use --attention-backend nvfp4_xqa" in out


@pytest.mark.parametrize("flag", ["CUSTOM", "nvfp4_xqa", "NVFP4_XQA"])
def test_cli_flag_resolves_to_backend(tiny_model, flag):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_model, "--skip-tokenizer-init", "--max-model-len", "1024",
                              "--kv-cache-dtype", "nvfp4", "--attention-backend", flag])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.attention_config.backend.get_class() is Nvfp4XqaBackend
    assert config.cache_config.cache_dtype == "nvfp4"


def test_attention_config_python_path():
    # LLM(..., attention_config={"backend": ...}) builds this object.
    from vllm.config import AttentionConfig
    assert AttentionConfig(backend="CUSTOM").backend.get_class() is Nvfp4XqaBackend
    assert AttentionConfig(backend="nvfp4_xqa").backend.get_class() is Nvfp4XqaBackend


def test_hyphenated_name_is_rejected_by_vllm(make_config):
    # Documented limitation: vLLM upper-cases the flag and only accepts identifiers as names.
    with pytest.raises(ValueError, match="Unknown attention backend"):
        make_config(attention_backend="nvfp4-xqa")
