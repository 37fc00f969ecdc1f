"""Custom Metal kernels and the switch that picks them.

`MACINFER_KERNELS` = `auto` (default: Metal kernels when `mx.metal.is_available()`,
else the reference MLX ops), `metal` (insist), `reference` (never use kernels),
or `emulate` (run the exact generated Metal source through the CPU emulator in
`macinfer.kernels.emulator`; slow, for verification on machines without a GPU).
"""

from __future__ import annotations

import os

import mlx.core as mx

MODES = ("auto", "metal", "reference", "emulate")


_configured: str | None = None


def configure(backend: str | None) -> None:
    """Fix the backend for this process (the engine does it once at load, after
    its self-check); None goes back to reading MACINFER_KERNELS."""
    global _configured
    _configured = backend


def mode() -> str:
    """The attention backend in force: 'metal', 'reference' or 'emulate'."""
    return _configured or requested_mode()


def requested_mode() -> str:
    """What MACINFER_KERNELS asks for, resolved against this machine."""
    choice = os.environ.get("MACINFER_KERNELS", "auto").lower()
    if choice not in MODES:
        raise ValueError(f"MACINFER_KERNELS={choice!r}; expected one of {', '.join(MODES)}")
    if choice == "auto":
        return "metal" if mx.metal.is_available() else "reference"
    if choice == "metal" and not mx.metal.is_available():
        raise RuntimeError("MACINFER_KERNELS=metal but MLX has no Metal device here")
    return choice
