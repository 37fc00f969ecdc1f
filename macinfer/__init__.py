"""macinfer: LLM inference on Apple Silicon with MLX."""

__version__ = "0.1.0"

from macinfer.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from macinfer.llm import LLM
from macinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "RequestOutput", "__version__"]
