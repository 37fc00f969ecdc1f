"""macinfer: LLM inference on Apple Silicon with MLX."""

import sys

if sys.version_info < (3, 10):  # before any import that would fail less clearly
    raise ImportError(f"macinfer needs Python 3.10 or newer; this is {sys.version.split()[0]}")

__version__ = "0.1.0"


def _import_mlx_lm_keeping_fd_limits() -> None:
    """mlx_lm sets RLIMIT_NOFILE to (2048, 4096) when imported: that fails (a
    traceback) where the hard limit is lower, and lowers a higher soft limit.
    The server sizes its own limit (macinfer.server.net)."""
    import resource

    real = resource.setrlimit
    resource.setrlimit = lambda *a, **k: None
    try:
        import mlx_lm.utils  # noqa: F401
    finally:
        resource.setrlimit = real


_import_mlx_lm_keeping_fd_limits()

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.llm import LLM
from macinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "RequestOutput", "__version__"]
