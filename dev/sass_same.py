"""Is the machine code of two trees' csrc/ the same?  Per kernel and arch, without a GPU.

Builds each decode source (or the ones named) of two trees for each arch with the project's nvcc flags
(jit.NVCC_FLAGS, jit.arch_flags), disassembles the cubins with cuobjdump and compares every kernel's
SASS, matched by mangled name: opcodes, operands and registers, with the instruction addresses
stripped (symbol order and line info may differ), and ptxas's resource usage (registers, shared
memory, stack).  A refactor that claims "no change in machine code" passes when every row says
`identical`.  The base is a git ref (exported with `git archive`), the other side a directory (the
work tree by default).  Cubins are cached by the hash of the csrc/ files, flags and arch, so a
baseline is built once; hd128 takes minutes per arch.  cuobjdump comes from the PyPI wheel:

    pip download --no-deps nvidia-cuda-cuobjdump -d /tmp/nv && unzip -oq /tmp/nv/*.whl -d /tmp/nv/x
    chmod +x /tmp/nv/x/nvidia/cu13/bin/*; export PATH=/tmp/nv/x/nvidia/cu13/bin:$PATH
    nice -n 10 python3 dev/sass_same.py --base HEAD --arch 80 90 120
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path[1:1] = [str(REPO / "dev"), str(REPO / "scripts")]  # sass_histogram.py, wherever it lives
from nvfp4_backend import jit  # noqa: E402
import sass_histogram  # noqa: E402

DECODE_SOURCES = ("paged_decode.cu", "paged_decode_hd64.cu", "paged_decode_hd128.cu", "paged_decode_hd256.cu")
ADDRESS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")
ENCODING = re.compile(r"/\*\s*0x[0-9a-f]{16}\s*\*/")


def tree_of_ref(ref: str, dest: Path) -> Path:
    """csrc/ of git ref `ref`, exported under dest."""
    blob = subprocess.run(["git", "-C", str(REPO), "archive", ref, "csrc"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "csrc"


def nvcc_command(csrc: Path, source: str, arch: int, cache: Path) -> tuple[Path, list[str]]:
    """Where the cubin of csrc/source for sm_<arch> is cached (named by the hash of csrc/, the flags and
    nvcc's version, so unchanged sources are not built again), and the command that builds it."""
    cap = (arch // 10, arch % 10)
    flags = [*jit.NVCC_FLAGS, *jit.extra_flags(), *jit.arch_flags(cap)]
    key = hashlib.sha256(jit.sources_digest(csrc).encode() + source.encode() + " ".join(flags).encode())
    key.update(subprocess.run(["nvcc", "--version"], check=True, capture_output=True).stdout)
    cubin = cache / f"{source}.sm{arch}.{key.hexdigest()[:16]}.cubin"
    # the generated limits header (jit.limits_header, this tree's: both sides compile against the same)
    limits = f"-I{jit.limits_include_dir()}"
    return cubin, ["nvcc", "-cubin", str(csrc / source), "-o", str(cubin.with_suffix(".tmp")), *flags, f"-I{csrc}", limits]


def build(cubin: Path, command: list[str]) -> Path:
    if not cubin.exists():
        subprocess.run(command, check=True)
        cubin.with_suffix(".tmp").rename(cubin)
    return cubin


def sass_of(cubin: Path) -> str:
    return subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


def kernels(cubin: Path) -> dict[str, list[str]]:
    """Mangled kernel name -> its instructions (predicate, opcode, operands) without addresses, then its
    resource usage."""
    out: dict[str, list[str]] = {}
    name = None
    sass = sass_of(cubin)
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name and ADDRESS.match(line):
            out[name].append(ENCODING.sub("", ADDRESS.sub("", line)).strip())
    usage = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    for m in re.finditer(r"Function (\S+):\s*\n\s*(.*)", usage):
        if m.group(1) in out:
            out[m.group(1)].append("resources: " + m.group(2).strip())
    return out


def resource(instrs: list[str], key: str) -> str:
    res = next((i for i in instrs if i.startswith("resources: ")), "")
    m = re.search(key + r":(\d+)", res)
    return m.group(1) if m else "?"


def opcodes(instrs: list[str]) -> collections.Counter:
    """How often each opcode occurs (predicate guards and modifiers dropped)."""
    return collections.Counter(i.split()[1 if i.startswith("@") else 0].split(".")[0].rstrip(";")
                               for i in instrs if not i.startswith("resources: "))


def loop_summary(instrs: list[tuple[int, str, str]]) -> str:
    """The innermost HMMA loop (sass_histogram.hot_loop): its length and local-memory traffic."""
    body = sass_histogram.hot_loop(instrs)
    local = sum(op.startswith(("LDL", "STL")) for _, op, _ in body)
    return f"{len(body)} instructions, {local} local loads/stores"


def compare(base: dict[str, list[str]], new: dict[str, list[str]], base_sass: str = "", new_sass: str = ""
            ) -> list[tuple[str, str]]:
    rows = []
    base_loops, new_loops = sass_histogram.kernels(base_sass), sass_histogram.kernels(new_sass)
    for name in sorted(base.keys() | new.keys()):
        if name not in new:
            rows.append((name, "only in base"))
        elif name not in base:
            rows.append((name, "only in new"))
        elif base[name] == new[name]:
            rows.append((name, f"identical ({len(base[name]) - 1} instructions, {resource(base[name], 'REG')} registers)"))
        else:
            a, b = base[name], new[name]
            differing = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
            mix = "same instruction mix" if opcodes(a) == opcodes(b) else "instruction mix differs"
            loops = ""
            if name in base_loops and name in new_loops:
                loops = f", HMMA loop {loop_summary(base_loops[name])} -> {loop_summary(new_loops[name])}"
            rows.append((name, f"DIFFERENT: {len(a) - 1} -> {len(b) - 1} instructions ({differing} differ, {mix}), "
                               f"registers {resource(a, 'REG')} -> {resource(b, 'REG')}, stack (spills) "
                               f"{resource(a, 'STACK')} -> {resource(b, 'STACK')} bytes{loops}"))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git ref of the base tree (default HEAD)")
    p.add_argument("--new", type=Path, default=REPO, help="directory holding the other tree's csrc/ (default: this work tree)")
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90, 120])
    p.add_argument("--source", nargs="+", default=list(DECODE_SOURCES), help="csrc/ files to compare")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "sass_same-cache")
    p.add_argument("--jobs", type=int, default=1, help="parallel nvcc runs")
    p.add_argument("--rename", nargs=2, action="append", default=[], metavar=("PATTERN", "REPLACEMENT"),
                   help="a kernel renamed since the base: re.sub on the base's mangled names (repeatable)")
    args = p.parse_args()
    if shutil.which("cuobjdump") is None:
        print("cuobjdump must be on PATH (see this script's docstring)", file=sys.stderr)
        return 2
    args.cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base_csrc = tree_of_ref(args.base, Path(tmp))
        new_csrc = args.new / "csrc"
        jobs = [(arch, source) for arch in args.arch for source in args.source]
        commands = {(side, arch, source): nvcc_command(csrc, source, arch, args.cache)
                    for side, csrc in (("base", base_csrc), ("new", new_csrc)) for arch, source in jobs}
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            builds = {}  # one build per cubin: the two sides share those of unchanged sources
            for cubin, command in commands.values():
                builds.setdefault(cubin, pool.submit(build, cubin, command))
            different = 0
            for arch, source in jobs:
                base, new = (builds[commands[side, arch, source][0]].result() for side in ("base", "new"))
                base_kernels, base_sass = kernels(base), sass_of(base)
                for pattern, replacement in args.rename:
                    base_kernels = {re.sub(pattern, replacement, k): v for k, v in base_kernels.items()}
                    base_sass = re.sub(pattern, replacement, base_sass)
                rows = compare(base_kernels, kernels(new), base_sass, sass_of(new))
                print(f"sm_{arch} {source}: {len(rows)} kernels", flush=True)
                for name, verdict in rows:
                    print(f"  {verdict:<48} {name}", flush=True)
                    different += not verdict.startswith("identical")
    print("all identical" if different == 0 else f"{different} kernel(s) differ")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
