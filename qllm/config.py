"""Validated settings: per-request ``SamplingParams`` and per-engine ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    temperature 0 is greedy; ``top_k=-1`` and ``top_p=1`` disable those filters (a ``top_k``
    past the vocabulary keeps every token); ``seed`` makes a request's sampling reproducible
    regardless of what it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, "
                             f"got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def resolve_dtype(dtype) -> torch.dtype | None:
    """Accept a ``torch.dtype``, its name ("bfloat16", "float32", "bf16"...) or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(str(dtype), str(dtype)).removeprefix("torch.")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'bfloat16', 'float16', 'float32'")
    return resolved


@dataclass
class EngineConfig:
    """Engine-wide settings. ``LLM(...)`` keyword arguments map onto these fields."""

    model: str
    dtype: torch.dtype | None = None
    device: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    block_size: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    compile_on_cpu: bool = False
    # Inductor benchmarks Triton GEMM templates against cuBLAS for the decode layers' matmuls
    # (longer start-up). The projections are such matmuls only with the linear op pinned to
    # torch (kernels={"linear": "torch"}); a plugin's linear op is opaque to Inductor
    max_autotune_gemm: bool = False
    cudagraph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160,
                                              192, 224, 256)
    load_format: str = "auto"
    seed: int = 0
    recurrent_state_dtype: torch.dtype = torch.float32
    kernels: dict[str, str] = field(default_factory=dict)  # op -> implementation name
    async_scheduling: bool = True  # prepare step N+1 while step N runs on the device
    warm_up: bool = True  # on CUDA: dummy prefills at start-up (kernel JIT, tuning)
    # weight format (qllm_weight_formats hook), e.g. "int8" / "fp8" from qllm-kernels-int8;
    # None: the checkpoint's own quantization_config, else full precision
    quantization: str | None = None

    def __post_init__(self):
        self.dtype = resolve_dtype(self.dtype)
        self.recurrent_state_dtype = resolve_dtype(self.recurrent_state_dtype)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', "
                             f"got {self.load_format!r}")
        self.cudagraph_batch_sizes = tuple(sorted(set(self.cudagraph_batch_sizes)))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from ``LLM`` keyword arguments; an unknown keyword raises ``TypeError``."""
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}; "
                            f"known options: {sorted(known)}")
        return cls(model=model, **kwargs)
