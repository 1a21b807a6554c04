"""Rewrite the FlashInfer wheel without the CUDA sources of kernels the peer benchmark never builds.

A device call carries at most 64 MiB (the repo included); flashinfer-python 0.7.2.post1's wheel is
62 MB.  Its fa2 decode kernels JIT-build from the rest, so dropping `flashinfer/data/csrc/` of the
"cake" kernels, fused MoE and KDA (about 186 MB unpacked) leaves a 35 MiB wheel that works for
`dev/gpu_run.sh peers` and the FlashInfer cross-check test (a wheel slimmed by hand the same
way ran both at 3f594d5).

    python3 dev/slim_flashinfer_wheel.py .whl-fi .whl-fi-slim
    # then carry .whl-fi-slim (git-ignore it); dev/gpu_run.sh installs from either folder
"""
from __future__ import annotations

import argparse
import re
import shutil
import zipfile
from pathlib import Path

DROP = re.compile(r"^flashinfer/data/csrc/(cake_[^/]*|fused_moe|kda)/")


def slim(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if DROP.match(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # pip checks the files it lists
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not DROP.match(line.split(",", 1)[0])).encode()
            zout.writestr(info, data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="folder with the flashinfer-python, apache-tvm-ffi (and tqdm) wheels")
    p.add_argument("dst", type=Path, help="output folder")
    args = p.parse_args()
    args.dst.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(args.src.glob("*.whl")):
        out = args.dst / wheel.name
        if wheel.name.startswith("flashinfer_python-"):
            slim(wheel, out)
        else:
            shutil.copy2(wheel, out)
        print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
