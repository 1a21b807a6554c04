"""Static SASS instruction counts of csrc/ kernels, without a GPU.

Compiles one source for one arch with the project's nvcc flags (and NVFP4_BACKEND_NVCC_FLAGS, as the JIT
build takes them: a variant's -D switches), disassembles it with cuobjdump
and prints, per kernel, ptxas's registers and spill bytes, the instruction count, the top opcodes
and (--loop) the size of the innermost loop that holds HMMA instructions (the decode kernel's hot
loop) with the local-memory loads and stores inside it (spills that cost every tile).  cuobjdump and
nvdisasm are not in every CUDA install; the PyPI wheels carry them:

    pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d /tmp/nv
    for w in /tmp/nv/*.whl; do unzip -oq "$w" -d /tmp/nv/x; done
    chmod +x /tmp/nv/x/nvidia/cu13/bin/*; export PATH=/tmp/nv/x/nvidia/cu13/bin:$PATH
    python3 dev/sass_histogram.py csrc/paged_decode_hd128.cu --arch 90 --match Li128ELi1ELi1E --loop
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from nvfp4_backend import jit  # noqa: E402

INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def disassemble(source: Path, arch: int, defines: list[str]) -> tuple[str, dict[str, str]]:
    """The SASS, and per kernel ptxas's register and spill report."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cap = (arch // 10, arch % 10)
        built = subprocess.run(["nvcc", "-cubin", str(source), "-o", str(cubin), *jit.NVCC_FLAGS, *jit.extra_flags(),
                                *jit.arch_flags(cap), f"-I{REPO / 'csrc'}", f"-I{jit.limits_include_dir()}", *[f"-D{d}" for d in defines],
                                "-Xptxas", "-v"], check=True, capture_output=True, text=True)
        usage, name = {}, None
        for line in built.stderr.splitlines():
            m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)", line)
            if m:
                name = m.group(1)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and name:
                usage[name] = f"spills {m.group(1)}/{m.group(2)} bytes"
            m = re.search(r"Used (\d+) registers", line)
            if m and name:
                usage[name] = f"{m.group(1)} registers, " + usage.get(name, "")
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
        return sass, usage


def kernels(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """Kernel name -> [(address, opcode, operands)]."""
    out, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSTR.match(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def hot_loop(instrs: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The smallest backward-branch range that contains an HMMA: the innermost MMA loop."""
    best = None
    for addr, op, args in instrs:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            target = int(m.group(1), 16) if m else None
            if target is not None and target < addr:
                body = [i for i in instrs if target <= i[0] <= addr]
                if any(o.startswith("HMMA") for _, o, _ in body) and (best is None or len(body) < len(best)):
                    best = body
    return best or []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--match", default="", help="only kernels whose mangled name contains this")
    p.add_argument("-D", dest="defines", action="append", default=[], help="extra preprocessor define")
    p.add_argument("--loop", action="store_true", help="also count the innermost HMMA loop")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not (shutil.which("cuobjdump") and shutil.which("nvdisasm")):
        print("cuobjdump and nvdisasm must be on PATH (see this script's docstring)", file=sys.stderr)
        return 2
    sass, usage = disassemble(args.source, args.arch, args.defines)
    for name, instrs in kernels(sass).items():
        if args.match not in name:
            continue
        count = collections.Counter(op.split(".")[0] for _, op, _ in instrs)
        print(f"{name}\n  {usage.get(name, '')}\n  {len(instrs)} instructions: {count.most_common(args.top)}")
        if args.loop:
            body = hot_loop(instrs)
            loop = collections.Counter(op.split(".")[0] for _, op, _ in body)
            # a spill inside the loop costs every tile; one in the prologue is harmless
            print(f"  innermost HMMA loop: {len(body)} instructions (local loads {loop['LDL']}, stores {loop['STL']}): "
                  f"{loop.most_common(args.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
