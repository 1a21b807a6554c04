"""Build FlashInfer's JIT modules that a device call will use, all at once, before the tests and benchmarks.

FlashInfer builds each kernel variant on its first use, one after another: an FA3 prefill module
(one per dtype, head dim, sliding window and soft cap) takes about a minute and a half of a 16-core
machine.  Planning one tiny problem per variant in parallel processes builds them side by side, so a
device call pays the slowest build instead of the sum.  VARIANTS are the ones tests/gpu/test_dense.py
and `bench --prefill` / `bench --step` use.

    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 dev/prebuild_flashinfer.py
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import time

# (dtype, head dim, sliding window, soft cap) of the FA3 ragged prefill (dense_prefill's dense kernel)
VARIANTS = [
    ("bfloat16", 128, False, False),
    ("bfloat16", 128, True, False),
    ("bfloat16", 128, False, True),
    ("bfloat16", 64, True, False),
    ("bfloat16", 256, True, True),
    ("float16", 128, False, False),
]


def build_fa3(variant) -> str:
    import torch
    import flashinfer
    dtype_name, head_dim, window, soft_cap = variant
    dtype = getattr(torch, dtype_name)
    t0 = time.time()
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                        backend="fa3")
    indptr = torch.tensor([0, 16], dtype=torch.int32)
    w.plan(indptr, indptr, 8, 2, head_dim, causal=True, window_left=7 if window else -1,
           logits_soft_cap=30.0 if soft_cap else None, q_data_type=dtype, kv_data_type=dtype)
    return f"fa3 {variant}: {time.time() - t0:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated indices into VARIANTS (default: all)")
    args = ap.parse_args()
    chosen = [VARIANTS[int(i)] for i in args.only.split(",")] if args.only else VARIANTS
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(chosen), mp_context=ctx) as pool:
        futures = [pool.submit(build_fa3, v) for v in chosen]
        for f in concurrent.futures.as_completed(futures):
            try:
                print(f.result(), flush=True)
            except Exception as exc:  # a variant that fails to build fails its tests later, with the reason
                print(f"build failed: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
    print(f"prebuild: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
