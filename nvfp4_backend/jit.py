"""Build and load the CUDA kernels (csrc/) on first use, through torch's ninja-based JIT.

The build is cached per torch version, CUDA version and GPU architecture (one module name per
combination), so a second process loads it at once.  An ahead-of-time build (setup.py,
``NVFP4_BACKEND_AOT=1``) is used instead where it serves the device, torch and CUDA at hand
(``NVFP4_BACKEND_PREBUILT=0`` ignores it).  Every build compiles against ``nvfp4_limits.h``, which
it writes from ``capabilities`` (``limits_header``).  ``NVFP4_BACKEND_VERBOSE_BUILD=1`` shows the
compiler; ``capabilities.kernels_available`` says whether the kernels run here.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import torch

from . import capabilities

KERNEL_SOURCES = ("write_kv.cu", "paged_decode.cu", "paged_decode_hd64.cu", "paged_decode_hd128.cu",
                  "paged_decode_hd256.cu", "decode_limits.cu", "paged_prefill.cu", "paged_prefill_hd64.cu",
                  "paged_prefill_hd128.cu", "paged_prefill_hd256.cu", "dequantize_kv.cu")
BINDING_SOURCE = "binding.cpp"
LIMITS_HEADER = "nvfp4_limits.h"
"""The generated header of capabilities' limits that csrc/ includes (``limits_header``)."""


def csrc_dir() -> Path:
    """The kernel sources: a checkout's csrc/, or the copy an installed wheel holds in the package
    (pyproject's package-dir; a namespace package, so importlib.resources would hand back a
    MultiplexedPath, not a directory)."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "csrc", package / "csrc"):
        if (candidate / BINDING_SOURCE).exists():
            return candidate
    raise FileNotFoundError(f"the kernel sources ({BINDING_SOURCE}) are in neither {package.parent / 'csrc'} "
                            f"nor {package / 'csrc'}")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    major, minor = capability
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__"]


CXX_FLAGS = ["-O3", "-g0"]
"""Host compiler flags for the binding (torch passes the host compiler no optimization level)."""


def extra_flags() -> list[str]:
    """``NVFP4_BACKEND_NVCC_FLAGS``: extra nvcc flags for experiments (they get their own build)."""
    return os.environ.get("NVFP4_BACKEND_NVCC_FLAGS", "").split()


def module_name(capability: tuple[int, int]) -> str:
    tv = torch.__version__.split("+")[0].replace(".", "_")
    cv = (torch.version.cuda or "none").replace(".", "_")
    name = f"nvfp4_backend_C_torch{tv}_cu{cv}_sm{capability[0]}{capability[1]}"
    if extra_flags():
        name += "_" + hashlib.sha1(" ".join(extra_flags()).encode()).hexdigest()[:8]
    return name


PREBUILT = "nvfp4_backend._C"
"""The ahead-of-time build (setup.py with NVFP4_BACKEND_AOT=1), with PREBUILT_INFO beside it."""
PREBUILT_INFO = "_C.json"


def limits_header() -> str:
    """The text of nvfp4_limits.h: capabilities' limits as C++ constants, so the kernels, their
    dispatch and the binding compile against the numbers the planner and the ops check, and
    csrc/decode_limits.cu checks those that follow from the kernels' layout against it."""
    c = capabilities
    for name in ("DECODE_MAX_ROWS", "PREFILL_ROWS", "DECODE_BLOCKS_PER_SM"):
        if set(getattr(c, name)) != set(c.SUPPORTED_HEAD_DIMS):
            raise ValueError(f"capabilities.{name} must cover SUPPORTED_HEAD_DIMS {c.SUPPORTED_HEAD_DIMS}, "
                             f"got {sorted(getattr(c, name))}")
    if any(len(counts) != len(c.DECODE_ROW_BANDS) for counts in c.DECODE_BLOCKS_PER_SM.values()):
        raise ValueError(f"capabilities.DECODE_BLOCKS_PER_SM must give {len(c.DECODE_ROW_BANDS)} counts (one per "
                         f"DECODE_ROW_BANDS) per head dim, got {c.DECODE_BLOCKS_PER_SM}")
    constants = {
        "kHeadDims": ("SUPPORTED_HEAD_DIMS", c.SUPPORTED_HEAD_DIMS),
        "kDecodeMaxRows": ("DECODE_MAX_ROWS", tuple(c.DECODE_MAX_ROWS[d] for d in c.SUPPORTED_HEAD_DIMS)),
        "kPrefillRows": ("PREFILL_ROWS", tuple(c.PREFILL_ROWS[d] for d in c.SUPPORTED_HEAD_DIMS)),
        "kMaxSplits": ("MAX_SPLITS", c.MAX_SPLITS),
        "kRowTile": ("ROW_TILE", c.ROW_TILE),
        "kDecodeRowBands": ("DECODE_ROW_BANDS", c.DECODE_ROW_BANDS),
        # [head dim][row band], flattened
        "kDecodeBlocksPerSm": ("DECODE_BLOCKS_PER_SM", tuple(n for d in c.SUPPORTED_HEAD_DIMS for n in c.DECODE_BLOCKS_PER_SM[d])),
        "kPackedMaxHeads": ("PACKED_MAX_HEADS", c.PACKED_MAX_HEADS),
        "kFusedHeadDims": ("FUSED_HEAD_DIMS", c.FUSED_HEAD_DIMS),
        "kFusedMaxRows": ("FUSED_MAX_ROWS", c.FUSED_MAX_ROWS),
        "kFusedHeadTiles": ("FUSED_HEAD_TILES", c.FUSED_HEAD_TILES),
        "kFusedSharedMemory": ("FUSED_SHARED_MEMORY", c.FUSED_SHARED_MEMORY),
    }
    lines = ["// Generated by nvfp4_backend/jit.py (limits_header) from nvfp4_backend/capabilities.py: edit those.",
             "#pragma once", "", "namespace nvfp4 {"]
    for name, (source, value) in constants.items():
        if isinstance(value, tuple):
            lines.append(f"inline constexpr int {name}[] = {{{', '.join(map(str, value))}}};  // capabilities.{source}")
        else:
            lines.append(f"inline constexpr int {name} = {value};  // capabilities.{source}")
    return "\n".join(lines + ["}  // namespace nvfp4", ""])


def write_limits_header(directory: Path) -> Path:
    """Writes LIMITS_HEADER into ``directory`` (unless it already holds this text: an unchanged file
    keeps its time, so ninja rebuilds nothing) and returns ``directory``, for an include path."""
    directory.mkdir(parents=True, exist_ok=True)
    path, text = directory / LIMITS_HEADER, limits_header()
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: a concurrent build reads the old or the new header, whole
    return directory


def limits_include_dir() -> Path:
    """Where the JIT build finds LIMITS_HEADER: a folder per header text under torch's extensions root,
    so other limits are another include path, which torch's JIT takes for a new build."""
    from torch.utils.cpp_extension import get_default_build_root
    text_digest = hashlib.sha256(limits_header().encode()).hexdigest()[:16]
    return write_limits_header(Path(get_default_build_root()) / "nvfp4_backend_limits" / text_digest)


def sources_digest(src: Path) -> str:
    """sha256 of csrc/ (every file, by name) and of the generated limits: a prebuilt library of other
    sources or other limits is not used."""
    digest = hashlib.sha256()
    for path in sorted(p for p in src.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(LIMITS_HEADER.encode() + b"\0" + limits_header().encode())
    return digest.hexdigest()


def prebuilt_info(gencode_flags: list[str]) -> dict:
    """What _C.json records of an ahead-of-time build (setup.py writes it, _prebuilt reads it): the
    -gencode flags torch built with, torch, CUDA, and the sources' digest."""
    return dict(gencode=list(gencode_flags), torch=torch.__version__, cuda=torch.version.cuda,
                sources=sources_digest(csrc_dir()))


def prebuilt_serves(info: dict, capability: tuple[int, int]) -> bool:
    """Whether an ahead-of-time build runs here and is of these sources: the same torch, CUDA and
    csrc/, and for this arch either a cubin of the same major and a minor at or below it (sm_80
    runs on sm_86 and sm_89), an arch-specific cubin of exactly it (sm_90a), or PTX at or below it."""
    if not isinstance(info, dict) or info.get("torch") != torch.__version__ or info.get("cuda") != torch.version.cuda:
        return False
    if info.get("sources") != sources_digest(csrc_dir()):
        return False
    for flag in info.get("gencode", []):
        m = re.search(r"code=(sm|compute)_(\d+)(\d)([af]?)$", str(flag))
        if not m:
            continue
        kind, arch, specific = m[1], (int(m[2]), int(m[3])), m[4]
        if (arch == capability if specific else
                arch[0] == capability[0] and arch[1] <= capability[1] if kind == "sm" else arch <= capability):
            return True
    return False


def _prebuilt(capability: tuple[int, int]) -> Path | None:
    """The ahead-of-time build's library if one is installed and serves this device; None otherwise."""
    if os.environ.get("NVFP4_BACKEND_PREBUILT", "1") == "0" or extra_flags():
        return None
    spec = importlib.util.find_spec(PREBUILT)
    if spec is None or spec.origin is None:
        return None
    library = Path(spec.origin)
    try:
        info = json.loads(library.with_name(PREBUILT_INFO).read_text())
    except (OSError, ValueError):
        info = None
    if prebuilt_serves(info, capability):
        return library
    print(f"[nvfp4-backend] the prebuilt kernels ({library.name}) are not for sm_{capability[0]}{capability[1]}, torch "
          f"{torch.__version__}, CUDA {torch.version.cuda} and these sources: building them for this machine",
          file=sys.stderr, flush=True)
    return None


_loaded: dict[str, str] = {}   # the one kernel library of this process: {"library": path or JIT name}


def _register_once(library: str) -> None:
    """Each library registers the namespace nvfp4_backend_C, and a second registration aborts the
    process; so one library per process (a fat prebuilt one serves several archs)."""
    if _loaded.setdefault("library", library) != library:
        raise RuntimeError(f"nvfp4-backend: the kernels are already loaded from {_loaded['library']}; "
                           f"a second GPU arch needs {library}, and one process holds one kernel library")


@functools.cache
def _load_for(capability: tuple[int, int]):
    library = _prebuilt(capability)
    if library is not None:
        _register_once(str(library))
        try:
            torch.ops.load_library(str(library))  # registers torch.ops.nvfp4_backend_C
            return torch.ops.nvfp4_backend_C
        except OSError as exc:  # dlopen failed (e.g. a newer libstdc++): nothing was registered
            _loaded.clear()
            print(f"[nvfp4-backend] the prebuilt kernels do not load ({exc}): building them for this machine",
                  file=sys.stderr, flush=True)
    from torch.utils.cpp_extension import load
    src = csrc_dir()
    name = module_name(capability)
    _register_once(name)
    verbose = os.environ.get("NVFP4_BACKEND_VERBOSE_BUILD") == "1"
    print(f"[nvfp4-backend] loading CUDA kernels {name} (the first build takes about a minute)...",
          file=sys.stderr, flush=True)
    load(name=name, sources=[str(src / s) for s in (BINDING_SOURCE, *KERNEL_SOURCES)],
         extra_cflags=list(CXX_FLAGS),
         extra_cuda_cflags=NVCC_FLAGS + arch_flags(capability) + extra_flags(),
         extra_include_paths=[str(src), str(limits_include_dir())],
         is_python_module=False, verbose=verbose)
    return torch.ops.nvfp4_backend_C


def load(device: torch.device | None = None):
    """The kernel ops namespace (``torch.ops.nvfp4_backend_C``) built for ``device``'s arch."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    return _load_for(torch.cuda.get_device_capability(device))
