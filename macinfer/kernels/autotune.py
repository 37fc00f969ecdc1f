"""Verdicts of measurements taken at load, cached per device, MLX version and shape.

Where a step has more than one correct form on this device (MLA prompt chunks absorbed or
expanded, ...), the forms are timed once on the model's own shapes and the verdict is kept
in the user's cache folder (`MACINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/macinfer`, else
`~/.cache/macinfer`), so the next load reads it. `MACINFER_AUTOTUNE=0` turns measuring
off: each decision then takes its default form.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

log = logging.getLogger("macinfer")
_lock = threading.Lock()
MARGIN = 0.1  # another path must be this much faster than the default to replace it


def enabled(on: bool | None = None) -> bool:
    """`on` (an engine's `--no-autotune`: False), else MACINFER_AUTOTUNE."""
    if on is not None:
        return on
    return os.environ.get("MACINFER_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("MACINFER_CACHE_DIR"):
        return Path(os.environ["MACINFER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "macinfer"


def device_key(info: dict[str, Any] | None = None) -> str:
    """The device the verdicts hold for: MLX's device, its name (`mx.device_info()`: a Metal
    GPU's architecture, a CUDA GPU's or the CPU's name) and version, and the machine."""
    if info is None:
        try:
            info = dict(mx.device_info())
        except Exception:  # noqa: BLE001 - older MLX: no device info
            info = {}
    name = info.get("architecture") if mx.metal.is_available() else None
    name = name or info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    return f"{mx.default_device()}|{name}|{os.cpu_count()} cpus|mlx {mx.__version__}"


@dataclass(frozen=True)
class Tuning:
    """An engine's measuring: on (None: MACINFER_AUTOTUNE decides), and its device's key."""
    on: bool | None = None
    key: str | None = None  # None: this process's device

    @property
    def enabled(self) -> bool:
        return enabled(self.on)

    @property
    def device(self) -> str:
        return self.key or device_key()


def _path() -> Path:
    return cache_dir() / "autotune.json"


def _read() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def verdict(decision: str, shape: dict[str, Any], measure: Callable[[], dict], tuning: Tuning = Tuning()
            ) -> dict | None:
    """The cached verdict for `decision` on this device and `shape`, or `measure()`'s (a
    JSON-able dict), stored for the next load; None when measuring is off. A cached verdict
    comes back with `cached: True`."""
    if not tuning.enabled:
        return None
    key = f"{decision}|{tuning.device}|{json.dumps(shape, sort_keys=True)}"
    with _lock:
        known = _read().get(key)
    if known is not None:
        return dict(known, cached=True)
    found = measure()
    with _lock:
        table = _read()
        table[key] = found
        try:
            _path().parent.mkdir(parents=True, exist_ok=True)
            tmp = _path().with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            tmp.replace(_path())
        except OSError as e:  # a read-only home: measured again next time
            log.warning("autotune: cannot keep the verdict in %s (%s)", _path(), e)
    return found


def median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Median seconds of `fn` evaluated `repeats` times, after one warm-up run."""
    import time

    mx.eval(fn())  # warm-up (kernel compilation, buffer allocation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def forced(decision: str) -> str | None:
    """`MACINFER_FORCE_<DECISION>` (e.g. MACINFER_FORCE_DECODE_ATTENTION=reference): a path
    chosen by hand, which wins over any measurement."""
    value = os.environ.get(f"MACINFER_FORCE_{decision.upper()}")
    return value.strip().lower() if value else None


def choose(decision: str, shape: dict[str, Any], candidates: dict[str, Callable[[], Any] | None], default: str,
           timer: Callable[[Callable[[], Any]], float] = median_seconds, tuning: Tuning = Tuning()) -> str:
    """The path to take for `decision` on this device: each candidate is a function running
    that path once on the model's own shapes, or None where the path cannot run here (its
    self-check failed, or it is the CPU emulator: a correctness tool, never timed). The
    fastest wins, its verdict cached (`verdict`); `MACINFER_FORCE_<DECISION>` overrides;
    with measuring off, `default` (if it can run). Logged in one line."""
    viable = [name for name, fn in candidates.items() if fn is not None]
    override = forced(decision)
    if override is not None:
        if override not in candidates:
            raise ValueError(f"MACINFER_FORCE_{decision.upper()}={override!r}; expected one of "
                             f"{', '.join(candidates)}")
        if override not in viable:
            raise ValueError(f"MACINFER_FORCE_{decision.upper()}={override}: that path cannot run here "
                             "(its self-check failed or it needs another device)")
        log.info("%s: %s (forced by MACINFER_FORCE_%s)", decision, override, decision.upper())
        return override
    if not viable:
        raise ValueError(f"{decision}: no path can run here")
    if len(viable) == 1:
        return viable[0]

    def measure() -> dict:
        ms = {name: round(timer(candidates[name]) * 1e3, 4) for name in viable}
        best = min(viable, key=lambda n: ms[n])
        # The default stays unless another path is clearly faster: a few percent is noise
        # (another process, a cold cache), and a flip changes numerics run to run.
        if default in viable and ms[best] > ms[default] * (1 - MARGIN):
            best = default
        return {"choice": best, "ms": ms}

    found = verdict(decision, dict(shape, paths=viable), measure, tuning)
    if found is None:
        return default if default in viable else viable[0]
    log.info("%s: %s (%s ms on this device%s)", decision, found["choice"],
             ", ".join(f"{n} {t:g}" for n, t in found["ms"].items()), ", cached" if found.get("cached") else "")
    return found["choice"]


def table() -> str:
    """The verdicts measured on this device, a line each (`make mac-check` prints it)."""
    here = device_key()
    lines = []
    for key, found in sorted(_read().items()):
        decision = key.split("|", 1)[0]
        if not key.startswith(f"{decision}|{here}|"):  # another device's or MLX version's
            continue
        shape = key[len(f"{decision}|{here}|"):]
        if "ms" in found:
            detail = ", ".join(f"{name} {t:g} ms" for name, t in found["ms"].items())
        else:  # a verdict of another form (speculation's ratios by batch)
            detail = ", ".join(f"{k} {v}" for k, v in found.items() if k not in ("choice", "cached"))
        choice = found.get("choice", found.get("max_batch", "?"))
        lines.append(f"{decision:<18} {choice!s:<10} ({detail})  shape {shape}")
    return "\n".join(lines) or "(no verdicts measured on this device)"
