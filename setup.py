"""Ahead-of-time build of the CUDA kernels, for wheels.  Without NVFP4_BACKEND_AOT=1 the package is
pure Python and builds the kernels for the device at hand on first use (nvfp4_backend/jit.py).

    NVFP4_BACKEND_AOT=1 TORCH_CUDA_ARCH_LIST="8.0;9.0;12.0" pip wheel --no-build-isolation --no-deps .

builds nvfp4_backend/_C.so (torch.utils.cpp_extension.CUDAExtension, the same sources, nvcc flags and
generated limits header as the JIT build) next to _C.json, which records the -gencode flags, torch, CUDA and the sources'
digest.  jit.py loads it where it serves the device, torch, CUDA and sources at hand, and builds
otherwise.  TORCH_CUDA_ARCH_LIST takes torch's forms ("8.0;9.0;12.0", "Hopper", "9.0+PTX").  Made for
wheels (pip wheel, pip install .); a strict editable install does not carry _C.json.
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
    from torch.utils import cpp_extension

    sys.path.insert(0, str(ROOT))  # a PEP 517 build runs this file without the project on the path
    from nvfp4_backend import jit  # the one list of sources and flags
    if not torch.version.cuda:
        raise SystemExit(f"NVFP4_BACKEND_AOT=1 needs a CUDA build of torch, got {torch.__version__}")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        raise SystemExit("NVFP4_BACKEND_AOT=1 needs TORCH_CUDA_ARCH_LIST, e.g. \"8.0;9.0;12.0\"")

    class BuildWithInfo(cpp_extension.BuildExtension):
        """Writes jit.PREBUILT_INFO beside the library: the -gencode flags torch used, torch, CUDA and
        the sources' digest, which jit.prebuilt_serves checks before loading it."""
        def run(self):
            super().run()
            info = jit.prebuilt_info(cpp_extension._get_cuda_arch_flags())
            Path(self.get_ext_fullpath(jit.PREBUILT)).with_name(jit.PREBUILT_INFO).write_text(json.dumps(info))

    csrc = "csrc"  # relative: setuptools wants sources inside the project
    limits = jit.write_limits_header(ROOT / "build" / "limits")  # nvfp4_limits.h, as the JIT build writes it
    ext = cpp_extension.CUDAExtension(jit.PREBUILT, sources=[f"{csrc}/{s}" for s in (jit.BINDING_SOURCE, *jit.KERNEL_SOURCES)],
                                      include_dirs=[str(ROOT / csrc), str(limits)],
                                      # copies: BuildExtension appends its own flags to these lists
                                      extra_compile_args={"cxx": list(jit.CXX_FLAGS), "nvcc": list(jit.NVCC_FLAGS)})
    return dict(ext_modules=[ext], cmdclass={"build_ext": BuildWithInfo})


setup(**aot_build())
