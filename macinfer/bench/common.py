"""What every benchmark records: the context, percentiles, memory over time, and
the weights the reference engine gets (the same as macinfer's)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

import numpy as np


# Apple's published unified-memory bandwidth (GB/s), where one figure holds for the chip
# (M3 Max and M4 Max come in two, by GPU core count, so they are left out).
APPLE_BANDWIDTH_GBS = {
    "Apple M1": 68, "Apple M1 Pro": 200, "Apple M1 Max": 400, "Apple M1 Ultra": 800,
    "Apple M2": 100, "Apple M2 Pro": 200, "Apple M2 Max": 400, "Apple M2 Ultra": 800,
    "Apple M3": 100, "Apple M3 Pro": 150, "Apple M3 Ultra": 819, "Apple M4": 120, "Apple M4 Pro": 273,
}


def hardware() -> dict[str, Any]:
    """Chip, cores, memory and MLX device; on a Mac, the chip name and GPU cores."""
    import mlx.core as mx

    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cores": os.cpu_count(), "mlx_device": str(mx.default_device()),
                            "metal": mx.metal.is_available(), "blas_preload": os.environ.get("LD_PRELOAD", "")}
    chip = platform.processor()
    if platform.system() == "Darwin":
        chip = _sysctl("machdep.cpu.brand_string") or chip
        mem = _sysctl("hw.memsize")
        info["memory_gb"] = round(int(mem) / 2**30, 1) if mem else None
        if mx.metal.is_available():
            dev = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            info["gpu"] = {k: v for k, v in dev.items() if isinstance(v, (int, float, str))}
    else:
        try:
            with open("/proc/cpuinfo") as f:
                chip = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    info["chip"] = chip
    # The OS does not report memory bandwidth: Apple's published figure where there is one.
    bw = APPLE_BANDWIDTH_GBS.get(chip or "")
    info["memory_bandwidth"] = f"{bw} GB/s (Apple's published figure)" if bw else "not reported by the OS"
    return info


def _sysctl(name: str) -> str | None:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def energy() -> dict[str, Any]:
    """Tokens per joule need a power reading; macOS gives one only to root (powermetrics),
    Linux only through RAPL files that are usually root-only too."""
    return {"available": False, "why": "no power reading without root (macOS powermetrics, Linux RAPL)"}


def versions() -> dict[str, str]:
    import mlx.core as mx
    import mlx_lm

    import macinfer

    return {"macinfer": macinfer.__version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def percentiles(values: list[float], name: str) -> dict[str, float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {}
    return {f"{name}_p50": float(np.percentile(vals, 50)), f"{name}_p95": float(np.percentile(vals, 95)),
            f"{name}_p99": float(np.percentile(vals, 99)), f"{name}_mean": float(np.mean(vals))}


def rss_gb(pid: int) -> float | None:
    """Resident memory of a process now (Linux /proc; elsewhere `ps`)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=5).stdout
        return int(out.strip()) / 2**20 if out.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


class MemorySampler:
    """Samples a process's RSS every `interval` seconds on a thread: (seconds, GB) pairs."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            gb = rss_gb(self.pid)
            if gb is not None:
                self.samples.append((time.perf_counter() - self._start, gb))
            self._stop.wait(self.interval)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    @property
    def peak_gb(self) -> float | None:
        return max((gb for _, gb in self.samples), default=None)


def save_json(results: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    return path


def same_weights_dir(model: str) -> tuple[str, str]:
    """An MLX directory mlx-lm loads with the weights macinfer runs: on the CPU backend,
    where macinfer expands quantized layers to float32, the expanded float32 weights;
    elsewhere, the quantized ones. Returns (directory, description)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load as mlx_lm_load

    from macinfer.loading.convert import convert_gguf
    from macinfer.loading.loader import _dequantize_modules, resolve, should_dequantize

    path = resolve(model)
    src = convert_gguf(path, tempfile.mkdtemp(prefix="macinfer-bench-")) if path.endswith(".gguf") else path
    lm, _ = mlx_lm_load(src)
    if not should_dequantize(lm):
        quantized = any("scales" in name for name, _ in tree_flatten(lm.parameters()))
        return src, f"the same {'quantized ' if quantized else ''}weights as macinfer"
    _dequantize_modules(lm)
    if any("scales" in name for name, _ in tree_flatten(lm.parameters())):  # e.g. MoE experts (SwitchLinear)
        return src, "the quantized weights (macinfer keeps MoE experts quantized and expands dense layers)"
    out = tempfile.mkdtemp(prefix="macinfer-bench-f32-")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), dict(tree_flatten(lm.parameters())),
                        metadata={"format": "mlx"})
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            shutil.copy(os.path.join(src, name), out)
    return out, "macinfer's float32 expansion of the quantized weights (what macinfer runs on the CPU)"


def process_peak_rss_gb() -> float:
    """Peak resident memory of this process, GB."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if platform.system() == "Linux" else rss / 2**30


def quantized_draft(model_dir: str, bits: int) -> str:
    """An MLX directory of the model in `model_dir` with its layers quantized to `bits`
    (group size 64), as mlx-lm's convert writes it."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import quantize_model, save_model

    model, tokenizer = mlx_lm_load(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    model, config = quantize_model(model, config, group_size=64, bits=bits)
    out = tempfile.mkdtemp(prefix=f"macinfer-draft-q{bits}-")
    save_model(out, model)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer.save_pretrained(out)
    return out
