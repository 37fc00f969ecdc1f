"""OpenBLAS for MLX's CPU backend on Linux, and the `macinfer` command's entry point.

MLX's CPU matmuls go through whatever BLAS the process has bound, and with OpenBLAS they run
~20x faster than without (a 330-token prompt's first token: 0.9 s against 19 s on SmolLM2).
Importing `macinfer` (the command's first step too) loads it with RTLD_GLOBAL before MLX is
loaded (`macinfer/__init__.py`), so MLX binds to it; where it is not installed, one line
says how to get it."""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping

OPENBLAS = "/usr/lib/*/openblas-pthread/libopenblas.so.0"  # Debian/Ubuntu's libopenblas0-pthread


def openblas_to_preload(environ: Mapping[str, str], loaded: str, candidates: list[str]) -> str | None:
    """The library to preload, or None: not Linux, turned off (MACINFER_NO_PRELOAD), already
    loaded or preloaded (`loaded`: /proc/self/maps), done once already, or not installed."""
    if sys.platform != "linux" or environ.get("MACINFER_NO_PRELOAD") or environ.get("MACINFER_PRELOADED"):
        return None
    if "libopenblas" in loaded or "libopenblas" in environ.get("LD_PRELOAD", ""):
        return None
    return candidates[0] if candidates else None


def openblas_plan() -> tuple[str | None, str | None]:
    """(the OpenBLAS to load, or None; a line to print when it is missing, or None), from
    what this process has loaded (/proc/self/maps) and what is installed."""
    if sys.platform != "linux":
        return None, None
    try:
        with open("/proc/self/maps") as f:
            loaded = f.read()
    except OSError:
        loaded = ""
    found = sorted(glob.glob(OPENBLAS))
    missing = None
    if not found and "libopenblas" not in loaded and not os.environ.get("MACINFER_NO_PRELOAD"):
        missing = ("macinfer: OpenBLAS is not installed; MLX's CPU matmuls are ~20x slower without it "
                   "(sudo apt install libopenblas0-pthread; MACINFER_NO_PRELOAD=1 silences this)")
    return openblas_to_preload(os.environ, loaded, found), missing


def main() -> None:
    # `import macinfer` (above this module) has bound MLX to OpenBLAS already.
    from macinfer.cli.main import main as cli

    cli()


if __name__ == "__main__":
    main()
