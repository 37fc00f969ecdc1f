"""Batched decode quantized matmul (and fused SwiGLU) Metal kernels.

On Metal, used when it beats `mx.quantized_matmul` on the model's own MLP at load
(`engine/choices.py`; `MACINFER_FORCE_QMV=kernel|mlx`); `scripts/mac_check.py`
measures it too. Correctness is checked everywhere through the CPU emulator.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from macinfer.kernels.call import KernelCall, kernel_source

MAX_ROWS = 32  # the decode batch sizes this kernel is for
QMV_INPUTS = ["x", "w", "scales", "biases"]
SWIGLU_INPUTS = QMV_INPUTS + ["w_up", "scales_up", "biases_up"]


def enabled() -> bool:
    """Whether MACINFER_QMV_KERNEL asks for the kernel outside an engine (its self-check
    then covers it); an engine's models take the verdict of `choices.choose_qmv`."""
    return os.environ.get("MACINFER_QMV_KERNEL", "0") == "1"


@lru_cache(maxsize=None)
def _kernel(fused: bool):
    src = f"#define MACINFER_FUSED_SWIGLU {int(fused)}\n{kernel_source('qmv_batched')}\n#undef MACINFER_FUSED_SWIGLU\n"
    return mx.fast.metal_kernel(
        name="macinfer_qmv_batched" + ("_swiglu" if fused else ""),
        input_names=SWIGLU_INPUTS if fused else QMV_INPUTS,
        output_names=["y"],
        source=src,
    )


def supported(layer, rows: int) -> bool:
    return (
        getattr(layer, "mode", "affine") == "affine"
        and getattr(layer, "bits", None) in (4, 8)
        and "biases" in layer
        and "bias" not in layer
        and layer.weight.shape[0] % 8 == 0
        and 1 <= rows <= MAX_ROWS
    )


def qmv_call(x: mx.array, layer, up_layer=None, rows_per_group: int = 8) -> KernelCall:
    """y = x @ W^T (or silu(x Wg^T) * (x Wu^T) with up_layer) for a QuantizedLinear."""
    M, K = x.shape
    N = layer.weight.shape[0]
    R = min(rows_per_group, M)
    fused = up_layer is not None
    inputs = [x, layer.weight, layer.scales, layer.biases]
    if fused:
        inputs += [up_layer.weight, up_layer.scales, up_layer.biases]
    return KernelCall(
        _kernel(fused), inputs,
        [("T", x.dtype), ("BITS", layer.bits), ("GS", layer.group_size), ("R", R)],
        (32, 2 * (N // 8), -(-M // R)), (32, 2, 1), [(M, N)], [x.dtype],
        SWIGLU_INPUTS if fused else QMV_INPUTS, ["y"],
    )
