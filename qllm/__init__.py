"""qllm: a torch.compile-first inference engine for Qwen3 and hybrid Qwen3.5 models."""

from qllm.config import EngineConfig, SamplingParams
from qllm.engine.llm import LLM
from qllm.engine.llm_engine import LLMEngine
from qllm.layers.logprobs import Logprob

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "Logprob"]
__version__ = "0.1.0"
