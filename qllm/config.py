"""Validated settings: per-request ``SamplingParams`` and per-engine ``EngineConfig``.

Both check every field against its annotation when built (``TypeError`` naming the field),
then its range (``ValueError`` naming the field).
"""

from __future__ import annotations

import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass, field, fields

import torch


def check_field_types(settings) -> None:
    """Raise ``TypeError`` naming the first field of the dataclass ``settings`` whose value
    does not match its annotation, or ``ValueError`` for a number that is not finite. A bool
    is not a number here; a list or tuple matches either annotation."""
    hints = _type_hints(type(settings))
    for f in fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
                and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}")
        if not _matches(value, hints[f.name]):
            raise TypeError(f"{f.name} must be of type {f.type}, got {value!r} "
                            f"({type(value).__name__})")


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _matches(value, hint) -> bool:
    """Whether ``value`` is of the type annotation ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                               for k, v in value.items())
    if hint in (int, float):
        number = numbers.Integral if hint is int else numbers.Real
        return isinstance(value, number) and not isinstance(value, bool)
    return isinstance(value, hint)


@dataclass
class SamplingParams:
    """How to sample one request and when to stop it.

    temperature 0 is greedy; ``top_k=-1`` and ``top_p=1`` disable those filters (a ``top_k``
    past the vocabulary keeps every token); ``seed`` makes a request's sampling reproducible
    regardless of what it is batched with; ``stop`` takes one string or a list of them. A
    value of the wrong type raises ``TypeError``, one out of range ``ValueError``, each naming
    the field.

    ``n`` completions per prompt (``LLM.generate``; choice i of a seeded request samples with
    ``seed + i``). ``logprobs=k`` returns, per generated token, the log-probabilities of the
    k most likely tokens and of the sampled one (with ranks); ``prompt_logprobs=k`` the same
    for each prompt token. Both are of the raw model distribution: before penalties,
    temperature and top-k/top-p, as vLLM's default. Penalties as vLLM defines them:
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) subtract from the logits of
    tokens generated so far (once, or once per occurrence); ``repetition_penalty`` (> 0, 1 is
    off) divides the positive and multiplies the negative logits of tokens in the prompt or
    generated. ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and stop
    strings are not checked, until that many tokens are generated.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        check_field_types(self)
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not all(self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        if self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), "
                             f"got {self.repetition_penalty!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def resolve_dtype(dtype, field: str = "dtype") -> torch.dtype | None:
    """Accept a ``torch.dtype``, its name ("bfloat16", "float32", "bf16"...) or None; errors
    name ``field``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"{field} must be a torch.dtype or its name, got {dtype!r}")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(dtype, dtype).removeprefix("torch.")
    resolved = getattr(torch, name, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown {field} {dtype!r}; use e.g. 'bfloat16', 'float16', "
                         f"'float32'")
    return resolved


def resolve_device(device: str | None) -> torch.device:
    """The device an engine runs on: ``device`` ("cpu", "cuda", "cuda:1"), by default CUDA
    when present, else the CPU. A device this machine lacks raises ``ValueError``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ValueError(f"device {device!r} is not available: this machine has "
                             f"{count} CUDA device(s) that torch can use; use device='cpu'")
    return resolved


@dataclass
class EngineConfig:
    """Engine-wide settings. ``LLM(...)`` keyword arguments map onto these fields."""

    model: str
    # a torch.dtype or its name; "auto": the checkpoint's; None: fp32 on CPU, the checkpoint's
    # half precision (else bfloat16) on GPU. The engine replaces it with the dtype it runs in
    dtype: torch.dtype | str | None = None
    device: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    block_size: int = 256
    enable_prefix_caching: bool = True
    # Prefix caching of models with recurrent (linear-attention) layers keeps copies of the
    # recurrent state at the branch points of shared prefixes, this many at most (each one
    # sequence's state of every such layer: ~64 MB fp32 / ~32 MB bf16 at Qwen3.5-35B-A3B
    # geometry, taken from the cache budget with the recurrent slots; none without
    # enable_prefix_caching). None: as many as 1 GiB holds, at most 32
    # (qllm.cache.recurrent_slots.default_state_checkpoints). 0: no prefix caching for such
    # models
    prefix_state_cache_slots: int | None = None
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    compile_on_cpu: bool = False
    # Inductor benchmarks Triton GEMM templates against cuBLAS for the decode layers' matmuls
    # (longer start-up). The projections are such matmuls only with the linear op pinned to
    # torch (kernels={"linear": "torch"}); a plugin's linear op is opaque to Inductor
    max_autotune_gemm: bool = False
    # decode batches pad up to the next size: every 8 pads at most 7 rows (200 running
    # sequences padded to 224 cost W2 about 3% with coarser sizes)
    cudagraph_batch_sizes: tuple[int, ...] = (1, 2, 4, *range(8, 513, 8))
    # a prefill step of one sequence that completes its prompt in at most the largest of
    # these many tokens replays a CUDA graph of the next size up (a short prompt's eager
    # prefill is launch-bound: hundreds of small kernels); multiples of 16, the sizes the
    # kernels are compiled for; () for none
    prefill_cudagraph_token_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    load_format: str = "auto"
    seed: int = 0
    recurrent_state_dtype: torch.dtype = torch.float32
    kernels: dict[str, str] = field(default_factory=dict)  # op -> implementation name
    async_scheduling: bool = True  # prepare step N+1 while step N runs on the device
    warm_up: bool = True  # on CUDA: dummy prefills at start-up (kernel JIT, tuning)
    # the persistent torch.compile / Triton cache (qllm.runner.compile_cache): None:
    # $QLLM_CACHE_DIR, else ~/.cache/qllm; "off": torch's and Triton's own defaults
    compile_cache_dir: str | None = None
    # weight format (qllm_weight_formats hook), e.g. "int8" / "fp8" from qllm-kernels-int8;
    # None: the checkpoint's own quantization_config, else full precision
    quantization: str | None = None
    # ranks of tensor parallelism (qllm.distributed): heads and intermediate dimensions split
    # over this many GPUs (gloo processes on CPU); 1: one process, no collectives
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.dtype != "auto":
            self.dtype = resolve_dtype(self.dtype)
        self.recurrent_state_dtype = resolve_dtype(self.recurrent_state_dtype,
                                                   "recurrent_state_dtype")
        check_field_types(self)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                     "kv_cache_memory_bytes", "num_kv_blocks", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.prefix_state_cache_slots is not None and self.prefix_state_cache_slots < 0:
            raise ValueError(f"prefix_state_cache_slots must be >= 0, "
                             f"got {self.prefix_state_cache_slots!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', "
                             f"got {self.load_format!r}")
        self.cudagraph_batch_sizes = tuple(sorted(set(self.cudagraph_batch_sizes)))
        self.prefill_cudagraph_token_sizes = tuple(sorted(set(
            self.prefill_cudagraph_token_sizes)))
        if any(size < 16 or size % 16 for size in self.prefill_cudagraph_token_sizes):
            raise ValueError(f"prefill_cudagraph_token_sizes must be positive multiples of 16, "
                             f"got {self.prefill_cudagraph_token_sizes!r}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Build from ``LLM`` keyword arguments; an unknown keyword raises ``TypeError``."""
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}; "
                            f"known options: {sorted(known)}")
        return cls(model=model, **kwargs)
