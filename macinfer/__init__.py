"""macinfer: LLM inference on Apple Silicon with MLX."""

import sys

if sys.version_info < (3, 10):  # before any import that would fail less clearly
    raise ImportError(f"macinfer needs Python 3.10 or newer; this is {sys.version.split()[0]}")

__version__ = "0.1.0"


def _load_openblas() -> None:
    """What the `macinfer` command does by preloading (`macinfer.launch`), for the Python API:
    on Linux, MLX's CPU matmuls use whatever BLAS the process has, ~20x faster with OpenBLAS.
    Loaded with RTLD_GLOBAL before MLX is, its symbols are the ones MLX binds to; when MLX
    was imported first, one line says how to get it."""
    from macinfer.launch import openblas_plan

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
