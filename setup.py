"""Ahead-of-time build of the CUDA kernels, for wheels.  Without NVFP4_BACKEND_AOT=1 the package is
pure Python and builds the kernels for the device at hand on first use (nvfp4_backend/jit.py).

    NVFP4_BACKEND_AOT=1 TORCH_CUDA_ARCH_LIST="8.0;9.0;12.0" pip wheel --no-build-isolation --no-deps .

builds nvfp4_backend/_C.so (torch.utils.cpp_extension.CUDAExtension, the same sources and nvcc flags
as the JIT build) next to _C.json, which names the archs, torch and CUDA it was built for.  jit.py
loads it when it serves the device, the torch and the CUDA at hand, and builds otherwise.
"""
import json
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def aot_build() -> dict:
    if os.environ.get("NVFP4_BACKEND_AOT") != "1":
        return {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sys.path.insert(0, str(ROOT))  # a PEP 517 build runs this file without the project on the path
    from nvfp4_backend import jit  # the one list of sources and flags
    if not torch.version.cuda:
        raise SystemExit(f"NVFP4_BACKEND_AOT=1 needs a CUDA build of torch, got {torch.__version__}")
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not archs:
        raise SystemExit("NVFP4_BACKEND_AOT=1 needs TORCH_CUDA_ARCH_LIST, e.g. \"8.0;9.0;12.0\"")

    class BuildWithInfo(BuildExtension):
        def run(self):
            super().run()
            info = dict(archs=archs, torch=torch.__version__, cuda=torch.version.cuda)
            Path(self.get_ext_fullpath("nvfp4_backend._C")).with_name("_C.json").write_text(json.dumps(info))

    csrc = "csrc"  # relative: setuptools wants sources inside the project
    ext = CUDAExtension("nvfp4_backend._C", sources=[f"{csrc}/{s}" for s in (jit.BINDING_SOURCE, *jit.KERNEL_SOURCES)],
                        include_dirs=[str(ROOT / csrc)],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": jit.NVCC_FLAGS})
    return dict(ext_modules=[ext], cmdclass={"build_ext": BuildWithInfo})


setup(**aot_build())
