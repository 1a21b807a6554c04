"""The CUDA binding's host side on a CPU-only machine: csrc/binding.cpp compiled against this torch's
headers (CUDA headers stubbed by tests/csrc/c10_cuda_stub), its error messages checked without a GPU.
CI's torch has no CUDA headers, so this is also where a compile error in the binding shows first."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

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
    cmd = [cxx, "-O1", "-std=c++17", "-w", f"-I{ROOT / 'tests' / 'csrc' / 'c10_cuda_stub'}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], f"-I{cuda_include}", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "csrc" / "binding_messages.cpp"), "-o", str(exe),
           f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("ok: 8 checks"), res.stdout + res.stderr
