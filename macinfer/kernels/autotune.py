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
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

log = logging.getLogger("macinfer")
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("MACINFER_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("MACINFER_CACHE_DIR"):
        return Path(os.environ["MACINFER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "macinfer"


def device_key() -> str:
    """The device the verdicts hold for: MLX's device and version, and the machine."""
    try:
        info = mx.metal.device_info() if mx.metal.is_available() else {}
    except Exception:  # noqa: BLE001 - older MLX: no device info
        info = {}
    name = info.get("architecture") or info.get("device_name") or platform.processor() or platform.machine()
    return f"{mx.default_device()}|{name}|{os.cpu_count()} cpus|mlx {mx.__version__}"


def _path() -> Path:
    return cache_dir() / "autotune.json"


def _read() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def verdict(decision: str, shape: dict[str, Any], measure: Callable[[], dict]) -> dict | None:
    """The cached verdict for `decision` on this device and `shape`, or `measure()`'s (a
    JSON-able dict), stored for the next load; None when measuring is off. A cached verdict
    comes back with `cached: True`."""
    if not enabled():
        return None
    key = f"{decision}|{device_key()}|{json.dumps(shape, sort_keys=True)}"
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
