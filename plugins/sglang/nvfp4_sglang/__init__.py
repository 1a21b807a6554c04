"""SGLang adapter: ``--attention-backend nvfp4-xqa`` over SGLang's NVFP4 KV pool.

SGLang (>= 0.5.23) runs every ``sglang.srt.plugins`` entry point before it parses arguments and
again in each scheduler process; ``register`` is that entry point.  The work is in
``registration`` (choices, registry, resolution hooks, KV access entry) and ``backend``.
"""
from __future__ import annotations

BACKEND_NAME = "nvfp4-xqa"
"""The new ``--attention-backend`` / ``--decode-attention-backend`` value."""


def register() -> None:
    """Entry point ``sglang.srt.plugins: nvfp4_xqa``; idempotent.

    NOTE: SGLang's plugin loader logs and swallows any ``Exception`` from a plugin, which would
    leave the server running without the backend and fail later on an unrelated-looking
    "invalid choice".  ``SystemExit`` passes through the loader, so a failed registration stops
    the process here with the reason.
    """
    try:
        from . import registration
        registration.register_all()
    except Exception as exc:
        raise SystemExit(
            f"nvfp4-backend: registering the SGLang attention backend {BACKEND_NAME!r} failed: "
            f"{type(exc).__name__}: {exc}. This plugin targets sglang 0.5.23; set SGLANG_PLUGINS "
            f"to another plugin list (or uninstall nvfp4-backend) to run SGLang without it.") from exc
