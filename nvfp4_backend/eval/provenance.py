"""What a results file records about where it was made: package versions, the device, the commit."""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import subprocess


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or "not installed"."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def device_name(device) -> str:
    """The GPU's name, or the CPU's."""
    import torch
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return f"cpu ({platform.processor() or platform.machine()})"


def git_commit() -> str | None:
    """The short commit of the checkout the package runs from (None outside one)."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None
