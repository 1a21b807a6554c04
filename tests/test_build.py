"""The build, on a CPU-only machine: the CUDA binding's host side (csrc/binding.cpp compiled against
this torch's headers, CUDA headers stubbed by tests/csrc/c10_cuda_stub, its error messages checked
without a GPU; CI's torch has no CUDA headers, so a compile error in the binding shows here first),
the generated limits header against the kernels' layout, and the choice between an ahead-of-time
build (setup.py) and the JIT build."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from nvfp4_backend import capabilities, jit

ROOT = Path(__file__).resolve().parent.parent


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    for base in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]:
        if (base / "include" / "cuda_runtime.h").exists():
            return base / "include"
    return None


def test_binding_error_messages_on_the_host(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    cuda_include = _cuda_include()
    if cxx is None or cuda_include is None:
        pytest.skip("needs a C++ compiler and the CUDA runtime headers (nvcc's toolkit)")
    lib = Path(torch.__file__).resolve().parent / "lib"
    exe = tmp_path / "binding_messages"
    limits = jit.write_limits_header(tmp_path / "limits")
    cmd = [cxx, "-O1", "-std=c++17", "-w", f"-I{ROOT / 'tests' / 'csrc' / 'c10_cuda_stub'}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{cuda_include}", f"-I{ROOT / 'csrc'}", f"-I{limits}",
           str(ROOT / "tests" / "csrc" / "binding_messages.cpp"), "-o", str(exe),
           f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("ok: 13 checks"), res.stdout + res.stderr


def _compile_limits_check(nvcc: str, limits: Path, obj: Path) -> subprocess.CompletedProcess:
    return subprocess.run([nvcc, "-c", str(ROOT / "csrc" / "decode_limits.cu"), "-o", str(obj), *jit.NVCC_FLAGS,
                           "-arch=sm_80", f"-I{ROOT / 'csrc'}", f"-I{limits}"], capture_output=True, text=True)


def test_the_kernels_layout_checks_the_generated_limits(tmp_path, monkeypatch):
    """csrc/decode_limits.cu static_asserts the generated limits that follow from the kernels' layout
    (shared memory, rows and heads per block, blocks per SM): the header of capabilities as they are compiles, and
    one with those limits changed fails with a message naming each."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    good = _compile_limits_check(nvcc, jit.write_limits_header(tmp_path / "good"), tmp_path / "good.o")
    assert good.returncode == 0, good.stderr
    monkeypatch.setattr(capabilities, "FUSED_SHARED_MEMORY", capabilities.FUSED_SHARED_MEMORY + 16)
    monkeypatch.setattr(capabilities, "DECODE_MAX_ROWS", capabilities.DECODE_MAX_ROWS | {256: 64})
    monkeypatch.setattr(capabilities, "PACKED_MAX_HEADS", 8)
    monkeypatch.setattr(capabilities, "FUSED_HEAD_DIMS", (64, 128, 256))
    monkeypatch.setattr(capabilities, "DECODE_BLOCKS_PER_SM", capabilities.DECODE_BLOCKS_PER_SM | {128: (4, 4, 2, 2)})
    monkeypatch.setattr(capabilities, "DECODE_ROW_BANDS", (8, 16, 32, 128))
    bad = _compile_limits_check(nvcc, jit.write_limits_header(tmp_path / "bad"), tmp_path / "bad.o")
    assert bad.returncode != 0
    for name in ("FUSED_SHARED_MEMORY", "DECODE_MAX_ROWS", "PACKED_MAX_HEADS", "FUSED_HEAD_DIMS", "DECODE_BLOCKS_PER_SM",
                 "DECODE_ROW_BANDS"):
        assert f"capabilities.{name} " in bad.stderr, bad.stderr


def test_the_limits_header_needs_a_blocks_per_sm_count_per_row_band(monkeypatch):
    """csrc reads DECODE_BLOCKS_PER_SM as [head dim][4 row bands]: a head dim with another count of
    bands would shift every later entry, so the header is refused."""
    monkeypatch.setattr(capabilities, "DECODE_BLOCKS_PER_SM", capabilities.DECODE_BLOCKS_PER_SM | {64: (4, 4, 2)})
    with pytest.raises(ValueError, match="DECODE_BLOCKS_PER_SM must give 4 counts"):
        jit.limits_header()


def test_the_limits_header_is_written_once_per_text(tmp_path, monkeypatch):
    """An unchanged header keeps its file (ninja rebuilds nothing); other limits are another JIT
    include folder (torch's JIT takes them for a new build) and another digest (a prebuilt library
    of other limits is not used)."""
    header = jit.write_limits_header(tmp_path) / jit.LIMITS_HEADER
    stamp = header.stat().st_mtime_ns
    jit.write_limits_header(tmp_path)
    assert header.stat().st_mtime_ns == stamp
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "root"))
    folder, digest = jit.limits_include_dir(), jit.sources_digest(ROOT / "csrc")
    monkeypatch.setattr(capabilities, "MAX_SPLITS", capabilities.MAX_SPLITS // 2)
    assert "kMaxSplits = 4096;" in jit.limits_header()
    assert jit.limits_include_dir() != folder and jit.sources_digest(ROOT / "csrc") != digest


def _info(*codes, **kw):
    """What setup.py records for -gencode flags with these code= targets."""
    return jit.prebuilt_info([f"-gencode=arch=compute_{c.split('_')[1]},code={c}" for c in codes]) | kw


@pytest.mark.parametrize("info, capability, serves", [
    (_info("sm_80", "sm_90", "sm_120"), (9, 0), True),
    (_info("sm_80"), (8, 9), True),                  # a cubin runs on its major's later minors
    (_info("sm_80", "sm_90"), (12, 0), False),       # not on another major
    (_info("sm_90a"), (9, 0), True),                 # arch-specific: that arch only
    (_info("sm_90a"), (10, 0), False),
    (_info("sm_80", "compute_90"), (12, 0), True),   # PTX at or below the device's arch
    (_info("compute_120"), (9, 0), False),           # PTX above it
    (_info("sm_90", torch="0.0.1"), (9, 0), False),  # another torch
    (_info("sm_90", cuda="99.9"), (9, 0), False),    # another CUDA
    (_info("sm_90", sources="0" * 64), (9, 0), False),  # other sources (an edited checkout)
    ({}, (9, 0), False), ([], (9, 0), False), (None, (9, 0), False),  # no or a malformed _C.json
])
def test_prebuilt_serves(info, capability, serves):
    assert jit.prebuilt_serves(info, capability) is serves


def test_prebuilt_is_chosen_only_where_it_serves(tmp_path, monkeypatch, capsys):
    library = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"")
    monkeypatch.setattr(jit.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(library)) if name == jit.PREBUILT else None)
    (tmp_path / jit.PREBUILT_INFO).write_text(json.dumps(_info("sm_90")))
    assert jit._prebuilt((9, 0)) == library
    assert jit._prebuilt((8, 0)) is None
    assert "not for sm_80" in capsys.readouterr().err
    monkeypatch.setenv("NVFP4_BACKEND_PREBUILT", "0")
    assert jit._prebuilt((9, 0)) is None
    monkeypatch.delenv("NVFP4_BACKEND_PREBUILT")
    monkeypatch.setenv("NVFP4_BACKEND_NVCC_FLAGS", "-DAB_X")  # an experiment's flags: its own build
    assert jit._prebuilt((9, 0)) is None
    monkeypatch.delenv("NVFP4_BACKEND_NVCC_FLAGS")
    (tmp_path / jit.PREBUILT_INFO).unlink()
    assert jit._prebuilt((9, 0)) is None                # a library without its _C.json is not trusted
    monkeypatch.setattr(jit.importlib.util, "find_spec", lambda name: None)
    assert jit._prebuilt((9, 0)) is None                # no ahead-of-time build installed


def test_one_kernel_library_per_process(monkeypatch):
    monkeypatch.setattr(jit, "_loaded", {})
    jit._register_once("nvfp4_backend_C_sm90")
    jit._register_once("nvfp4_backend_C_sm90")          # the same library again is fine
    with pytest.raises(RuntimeError, match="one process holds one kernel library"):
        jit._register_once("nvfp4_backend_C_sm80")


def test_sources_digest_follows_the_sources(tmp_path):
    for name in ("a.cu", "b.h", "notes.txt"):
        (tmp_path / name).write_text(name)
    before = jit.sources_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("changed")      # not a source
    assert jit.sources_digest(tmp_path) == before
    (tmp_path / "b.h").write_text("changed")
    assert jit.sources_digest(tmp_path) != before


def test_setup_without_aot_is_pure_python_and_aot_needs_archs():
    env = {k: v for k, v in os.environ.items() if k not in ("NVFP4_BACKEND_AOT", "TORCH_CUDA_ARCH_LIST")}
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "nvfp4-backend", res.stderr
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env | {"NVFP4_BACKEND_AOT": "1"},
                         capture_output=True, text=True)
    want = "needs TORCH_CUDA_ARCH_LIST" if torch.version.cuda else "needs a CUDA build of torch"
    assert res.returncode != 0 and want in res.stderr, res.stderr


def test_an_installed_wheel_finds_its_kernel_sources(tmp_path):
    """Where the JIT and a prebuilt library's digest look for csrc/ once installed (not a checkout):
    the package's own copy, with the checkout's digest."""
    env = {k: v for k, v in os.environ.items() if k not in ("NVFP4_BACKEND_AOT", "TORCH_CUDA_ARCH_LIST")}
    # from a copy of what the wheel is made of: an in-tree build would pack a stale build/lib (a
    # renamed kernel source, a prebuilt library) and write into the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("nvfp4_backend", "csrc", "plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "_C*", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path / "wheel"), str(src)], check=True, env=env)
    (wheel,) = (tmp_path / "wheel").glob("nvfp4_backend-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(tmp_path / "site"), str(wheel)], check=True)
    probe = ("import nvfp4_backend.jit as j; d = j.csrc_dir(); print(d); print(j.sources_digest(d))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=env | {"PYTHONPATH": str(tmp_path / "site")})
    assert res.returncode == 0, res.stderr
    where, digest = res.stdout.split()
    assert Path(where) == tmp_path / "site" / "nvfp4_backend" / "csrc"
    assert digest == jit.sources_digest(ROOT / "csrc")
