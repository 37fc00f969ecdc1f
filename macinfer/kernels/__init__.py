"""The device layer: the engine's `Backend` (memory, limits, the paths chosen at load),
custom Metal kernels with their self-check, emulator and load-time timing (`autotune`,
`choices`). Imports only MLX and NumPy; every other layer may import it.

Custom Metal kernels and the switch that asks for them:

`MACINFER_KERNELS` = `auto` (default: Metal kernels when `mx.metal.is_available()`,
else the reference MLX ops), `metal` (insist), `reference` (never use kernels),
or `emulate` (run the exact generated Metal source through the CPU emulator in
`macinfer.kernels.emulator`; slow, for verification on machines without a GPU).
"""

from __future__ import annotations

import os

import mlx.core as mx

MODES = ("auto", "metal", "reference", "emulate")


def requested_mode() -> str:
    """What MACINFER_KERNELS asks for, resolved against this machine (an engine's
    `Backend.kernel_mode` is this after its self-check)."""
    choice = os.environ.get("MACINFER_KERNELS", "auto").lower()
    if choice not in MODES:
        raise ValueError(f"MACINFER_KERNELS={choice!r}; expected one of {', '.join(MODES)}")
    if choice == "auto":
        return "metal" if mx.metal.is_available() else "reference"
    if choice == "metal" and not mx.metal.is_available():
        raise RuntimeError("MACINFER_KERNELS=metal but MLX has no Metal device here")
    return choice
