"""The device an engine runs on (CPU, Metal or CUDA) and every fact it decides with.

One `Backend` per engine, made at load: the memory the device can give (from
`mx.device_info()` where MLX reports it: the recommended working set on Metal, free GPU
memory on CUDA; available RAM on the CPU), the buffer-cache and wired limits, the kernel
mode its self-check passed, whether and under which key verdicts are measured
(`autotune`), and the paths chosen at load (`choices.Paths`). Readers take these from
their engine's backend, never from a module global, so two models loaded in one process
with different verdicts each run their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from macinfer.kernels.autotune import Tuning, device_key


def _kind() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu:
        return "cuda"
    return "cpu"


def _info() -> dict[str, Any]:
    try:
        return dict(mx.device_info())
    except Exception:  # noqa: BLE001 - an MLX without device_info, or no device to ask
        return {}


def _host_available() -> int:
    """The memory the OS reports as available right now."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class Backend:
    kind: str  # "cpu" | "metal" | "cuda"
    info: dict[str, Any] = field(default_factory=dict)  # what `mx.device_info()` reported
    kernel_mode: str = "reference"  # "metal" | "reference" | "emulate": after the self-check
    autotune: bool | None = None  # None: MACINFER_AUTOTUNE decides
    paths: Any = None  # `choices.Paths`, once chosen at load

    @classmethod
    def detect(cls, autotune: bool | None = None) -> "Backend":
        return cls(_kind(), _info(), autotune=autotune)

    @property
    def name(self) -> str:
        return str(self.info.get("device_name") or self.info.get("architecture") or self.kind)

    @property
    def tuning(self) -> Tuning:
        """Whether verdicts are measured, and the device they are kept under."""
        return Tuning(self.autotune, device_key(self.info))

    def available_memory(self) -> int:
        """What the device can give the KV cache before model weights are counted."""
        if self.kind == "metal" and "max_recommended_working_set_size" in self.info:
            return int(self.info["max_recommended_working_set_size"])
        if self.kind == "cuda":
            for key in ("free_memory", "total_memory", "memory_size"):
                if key in self.info:
                    return int(self.info[key])
        return _host_available()

    def set_limits(self, weights_bytes: int, kv_bytes: int) -> None:
        """MLX's buffer cache and wired memory for weights + a KV cache of these sizes."""
        if self.kind == "cpu" or mx.default_device() == mx.cpu:
            # MLX's CPU buffer cache defaults to 32 MiB: a step's attention temporaries
            # (gathered K/V, about the size of the KV in use) would be page-faulted in
            # fresh every step. Measured at 16 sequences x 1k context on SmolLM2:
            # 289k -> 10k page faults per decode step.
            mx.set_cache_limit(max(256 << 20, min(kv_bytes, self.available_memory() // 4)))
        if self.kind == "metal":
            # Keep weights + KV resident (wired) up to what Metal recommends, as mlx-lm does.
            mx.set_wired_limit(min(weights_bytes + kv_bytes, self.available_memory()))
