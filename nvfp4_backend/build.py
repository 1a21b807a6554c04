"""Compile-only check of csrc/ for several SM architectures (CI has nvcc but no GPU)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import jit


def compile_check(archs: list[str]) -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("compile-check: nvcc not found on PATH", file=sys.stderr)
        return 2
    import torch
    from torch.utils.cpp_extension import include_paths
    src = jit.csrc_dir()
    sources = list(jit.KERNEL_SOURCES)
    if torch.version.cuda:
        sources.append(jit.BINDING_SOURCE)
    else:  # a CPU torch ships no CUDA headers; the binding is arch-independent host code
        print(f"{jit.BINDING_SOURCE}: skipped (torch {torch.__version__} has no CUDA headers; "
              "tests/test_build.py compiles it against stubbed ones)")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        limits = jit.write_limits_header(Path(tmp))
        for arch in archs:
            cap = (int(arch[:-1]), int(arch[-1]))
            for name in sources:
                cmd = [nvcc, "-c", str(src / name), "-o", f"{tmp}/{name}.{arch}.o", *jit.NVCC_FLAGS,
                       *jit.arch_flags(cap), f"-I{src}", f"-I{limits}", "-Xptxas=-warn-spills", "--compiler-options", "-fPIC"]
                if name == jit.BINDING_SOURCE:
                    cmd += [f"-I{p}" for p in include_paths()]
                    cmd += ["-DTORCH_EXTENSION_NAME=nvfp4_backend_C", "-D_GLIBCXX_USE_CXX11_ABI=1"]
                t0 = time.time()
                res = subprocess.run(cmd, capture_output=True, text=True)
                status = "ok" if res.returncode == 0 else "FAILED"
                print(f"sm_{arch:<4} {name:<18} {status} ({time.time() - t0:.0f} s)", flush=True)
                if res.returncode:
                    failures += 1
                    print(res.stderr[-4000:], file=sys.stderr)
                elif "spill" in res.stderr and "0 bytes spill" not in res.stderr:
                    print(res.stderr[-2000:], file=sys.stderr)
    return 1 if failures else 0
