"""Build the FlashInfer JIT modules that device calls use, ahead of time, on any machine with nvcc.

FlashInfer builds each kernel variant on its first use: an FA3 prefill module (one per dtype, head
dim, sliding window and soft cap) takes about a minute and a half of a 16-core machine, device time
that a call then spends compiling.  The modules need no GPU to build (only nvcc and FlashInfer's
sources), and an FA3 one is about 2 MB, so they are built here once and carried: FlashInfer loads
``flashinfer/data/aot/<name>/<name>.so`` instead of building it (``jit.env.get_aot_artifacts``).

    # this machine (CPU only): build, and collect the .so files under .fi-aot/ (git-ignored)
    FLASHINFER_CUDA_ARCH_LIST=9.0a python dev/prebuild_flashinfer.py --aot-out .fi-aot
    # a device call: carry [".whl-fi-slim", ".fi-aot"]; dev/gpu_run.sh installs .fi-aot/ into FlashInfer

Without a local nvcc setup, the same command on the device builds them there, side by side.  On a
CPU machine, FlashInfer and what it imports go in a folder of their own (the interpreter here need
not be the device's: the .so files do not depend on it), and the link needs curand's headers, the
toolkit's libcudart and any libcuda.so (the link only records libcuda.so.1; the GPU machine's driver
provides it).  An FA3 module takes 10-20 minutes of one core here:

    pip install --no-deps --target /tmp/fisite .whl-fi/flashinfer_python-*.whl apache-tvm-ffi==0.1.15.post2 \
        nvidia-curand tqdm requests urllib3 idna charset_normalizer certifi packaging nvidia-ml-py einops click tabulate
    mkdir -p /tmp/cudastub && echo > /tmp/cudastub/e.c && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 \
        -o /tmp/cudastub/libcuda.so /tmp/cudastub/e.c
    PYTHONPATH=/tmp/fisite CPATH=/tmp/fisite/nvidia/cu13/include LIBRARY_PATH=/tmp/cudastub:/usr/local/cuda/lib64 \
        FLASHINFER_CUDA_ARCH_LIST=9.0a python dev/prebuild_flashinfer.py --only 0,1,2 --jobs 2 --aot-out .fi-aot
MODULES are the ones tests/gpu/test_dense.py, ``bench --prefill`` and ``bench --step`` use: the
FA3 ragged/paged prefill (dense_prefill's dense kernel, FlashInfer's BF16 peer) and FlashInfer's
FA2 prefill over NVFP4 pages (its NVFP4 peer).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import shutil
import time
from pathlib import Path

# (backend, q/o dtype, kv dtype, head dim, sliding window, soft cap); the list's index is the
# module's name on the command line (--only)
MODULES = [
    ("fa3", "bfloat16", "bfloat16", 128, False, False),
    ("fa3", "bfloat16", "bfloat16", 128, True, False),
    ("fa3", "bfloat16", "bfloat16", 128, False, True),
    ("fa3", "bfloat16", "bfloat16", 64, True, False),
    ("fa3", "bfloat16", "bfloat16", 256, True, True),
    ("fa3", "float16", "float16", 128, False, False),
    ("fa2", "bfloat16", "uint8", 128, False, False),  # FlashInfer's NVFP4 pages (packed E2M1 bytes)
    ("fa2", "bfloat16", "uint8", 128, True, False),
    # FlashInfer's decode (its tensor-core decode runs the FA2 prefill module) and FA2 prefill peers:
    # bench --zoo (D 64/128/256) and bench --step (D 128, and D 64 with a window for the gpt-oss mix)
    ("fa2", "bfloat16", "bfloat16", 128, False, False),
    ("fa2", "bfloat16", "float8_e4m3fn", 128, False, False),
    ("fa2", "bfloat16", "bfloat16", 64, False, False),
    ("fa2", "bfloat16", "float8_e4m3fn", 64, False, False),
    ("fa2", "bfloat16", "uint8", 64, False, False),
    ("fa2", "bfloat16", "bfloat16", 256, False, False),
    ("fa2", "bfloat16", "float8_e4m3fn", 256, False, False),
    ("fa2", "bfloat16", "uint8", 256, False, False),
    ("fa2", "bfloat16", "bfloat16", 64, True, False),
    ("fa2", "bfloat16", "float8_e4m3fn", 64, True, False),
    ("fa2", "bfloat16", "uint8", 64, True, False),
    ("page",),  # FlashInfer's append (BF16/FP8 and NVFP4 quantize-on-write): bench --step
    # the dense path under the fuzz harness's fixed seeds (tests/gpu/test_decode.py): fp16 at D 64 and 256
    ("fa3", "float16", "float16", 64, False, False),
    ("fa3", "float16", "float16", 256, False, False),
]


def specs(module):
    """FlashInfer's JitSpecs for one MODULES entry (an FA2 one over NVFP4 pages builds two: the primary
    and the paged one with independent K/V strides)."""
    if module[0] == "page":
        from flashinfer.jit.page import gen_page_module
        return [gen_page_module()]
    import torch
    from flashinfer.jit.attention import modules as m
    backend, qo, kv, head_dim, window, soft_cap = module
    args = (backend, getattr(torch, qo), getattr(torch, kv), getattr(torch, qo), torch.int32, head_dim, head_dim, 0,
            window, soft_cap, False)
    if backend == "fa2":
        primary = m._gen_batch_prefill_primary_module(*args)
        return [primary, m._gen_batch_prefill_independent_paged_module(*args)] if kv == "uint8" else [primary]
    return [m.gen_batch_prefill_module(*args)]


def build(module) -> list[tuple[str, str]]:
    """Build one MODULES entry; (name, path of its .so) for each of its specs."""
    built = []
    for spec in specs(module):
        if spec.is_aot:  # carried in (FlashInfer loads it as it is)
            built.append((spec.name, f"{spec.aot_path} (carried)"))
            continue
        spec.build()
        built.append((spec.name, str(spec.jit_library_path)))
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated indices into MODULES (default: all)")
    ap.add_argument("--jobs", type=int, default=0, help="modules built side by side (default: all of them)")
    ap.add_argument("--aot-out", type=Path, help="copy each built .so to AOT_OUT/<name>/<name>.so, as FlashInfer's "
                                                 "data/aot/ holds them")
    args = ap.parse_args()
    chosen = [MODULES[int(i)] for i in args.only.split(",")] if args.only else MODULES
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs or len(chosen), mp_context=ctx) as pool:
        futures = {pool.submit(build, m): m for m in chosen}
        for f in concurrent.futures.as_completed(futures):
            try:
                for name, so in f.result():
                    if args.aot_out and not so.endswith("(carried)"):
                        (args.aot_out / name).mkdir(parents=True, exist_ok=True)
                        shutil.copy2(so, args.aot_out / name / f"{name}.so")
                    print(f"{futures[f]}: {name} ({time.time() - t0:.0f} s)", flush=True)
            except Exception as exc:  # a module that fails to build fails its tests later, with the reason
                print(f"{futures[f]}: build failed: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
    print(f"prebuild: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
