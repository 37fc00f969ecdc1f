"""One kernel launch, described once, runnable on Metal or in the CPU emulator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

KERNEL_DIR = Path(__file__).resolve().parents[2] / "metal_kernels"


def kernel_source(name: str) -> str:
    """Body of metal_kernels/NAME.metal (the repository's kernel sources)."""
    path = KERNEL_DIR / f"{name}.metal"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the Metal kernel sources live in the repository's metal_kernels/ "
            "and are found from an editable install (pip install -e .); set MACINFER_KERNELS=reference "
            "to run without them"
        )
    return path.read_text()


@dataclass
class KernelCall:
    kernel: Any  # an mx.fast.metal_kernel
    inputs: list[mx.array]
    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    kernel_input_names: list[str]
    kernel_output_names: list[str]

    def __call__(self, verbose: bool = False) -> list[mx.array]:
        return self.kernel(inputs=self.inputs, template=self.template, grid=self.grid,
                           threadgroup=self.threadgroup, output_shapes=self.output_shapes,
                           output_dtypes=self.output_dtypes, verbose=verbose)


def launch(calls: list[KernelCall], emulate: bool = False) -> mx.array:
    """Run a chain of launches (each later call takes the previous call's outputs
    as its inputs) on Metal, or through the CPU emulator; returns the last output."""
    if emulate:
        from macinfer.kernels.emulator import emulate_calls

        return mx.array(emulate_calls(calls)[0])
    outs = calls[0]()
    for call in calls[1:]:
        call.inputs = list(outs)
        outs = call()
    return outs[0]
