"""macinfer: LLM inference on Apple Silicon with MLX."""

import glob
import os
import sys
from collections.abc import Mapping

if sys.version_info < (3, 10):  # before any import that would fail less clearly
    raise ImportError(f"macinfer needs Python 3.10 or newer; this is {sys.version.split()[0]}")

__version__ = "0.1.0"


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


def _load_openblas() -> None:
    """On Linux, MLX's CPU matmuls go through whatever BLAS the process has bound, and with
    OpenBLAS they run ~20x faster (a 330-token prompt's first token: 0.9 s against 19 s on
    SmolLM2). Loaded with RTLD_GLOBAL before MLX is, its symbols are the ones MLX binds to,
    for the Python API and the command alike; when MLX was imported first, or OpenBLAS is
    not installed, one line says how to get it."""
    lib, missing = openblas_plan()
    if lib is None:
        if missing:
            print(missing, file=sys.stderr)
        return
    if "mlx.core" in sys.modules:
        print(f"macinfer: MLX was imported before macinfer, without OpenBLAS: CPU matmuls run ~20x slower; "
              f"import macinfer first, or start Python with LD_PRELOAD={lib}", file=sys.stderr)
        return
    import ctypes

    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass


def _import_mlx_lm_keeping_fd_limits() -> None:
    """mlx_lm sets RLIMIT_NOFILE to (2048, 4096) when imported: that fails (a
    traceback) where the hard limit is lower, and lowers a higher soft limit.
    The server sizes its own limit (macinfer.server.net)."""
    import resource

    import warnings

    real = resource.setrlimit
    resource.setrlimit = lambda *a, **k: None
    try:
        with warnings.catch_warnings():
            # tqdm.auto in Jupyter without ipywidgets: our dependencies' progress bars, not ours
            warnings.filterwarnings("ignore", message="IProgress not found")
            import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real


_load_openblas()
_import_mlx_lm_keeping_fd_limits()

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.llm import LLM
from macinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "RequestOutput", "__version__"]
