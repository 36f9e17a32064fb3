"""The request and batch types that the engine, the caches, the runner, the layers and the
model plugins share: ``Sequence`` (one request), ``ScheduledBatch`` (the scheduler's step) and
``ForwardBatch`` (the model's step)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from qllm.config import SamplingParams

# where each field of a staged step lies in its one device buffer (``qllm.runner.staging``)
Layout = dict[str, tuple[int, int, torch.dtype, torch.Size]]  # offset, bytes, dtype, shape


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request: its prompt, generated tokens, and how much of it the cache holds.

    ``num_computed_tokens`` counts tokens whose KV/recurrent state is in the cache (or is being
    written by a launched step). Each step computes positions ``num_computed_tokens`` to
    ``num_computed_tokens + n``; once every position is computed the model samples the next
    token. A sampled token whose value has not reached the host yet is *pending*: it counts in
    ``len(seq)`` but not in ``token_ids`` until the scheduler appends it. Preemption resets
    ``num_computed_tokens`` to 0 and keeps the generated tokens, which are recomputed with the
    prompt on readmission. The scheduler alone moves a sequence through its lifecycle
    (``status``, ``num_computed_tokens``, ``num_cached_tokens``, ``num_pending_tokens``,
    ``finish_reason``). What a sequence holds in each cache kind (blocks, a slot...) is kept
    by that kind's pool, by ``seq_id``.
    """

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 request_id: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.finish_reason: str | None = None
        self.output_text = ""
        self.detokenizer = None  # an IncrementalDetokenizer when text is needed while running
        self.last_text_delta_len = 0
        self.num_preemptions = 0
        self.generator = None  # a torch.Generator when sampling_params.seed is set
        self.num_pending_tokens = 0  # sampled by a launched step, value not yet on the host
        # log-probs, when asked for (SamplingParams.logprobs / prompt_logprobs): per generated
        # token {token_id: Logprob}; per prompt token likewise, the first None
        self.logprobs: list[dict] | None = None if sampling_params.logprobs is None else []
        self.cumulative_logprob: float | None = \
            None if sampling_params.logprobs is None else 0.0
        self.prompt_logprobs: list[dict | None] | None = \
            None if sampling_params.prompt_logprobs is None else [None]
        # a request with media: its encoder inputs and rotary positions (qllm.model.multimodal)
        self.multimodal = None

    def __len__(self) -> int:
        """Tokens known plus tokens pending."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict | None = None) -> None:
        """Append a generated token, with its ``{token_id: Logprob}`` when log-probs are asked
        for; the output text follows when the sequence has a detokenizer."""
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        if self.detokenizer is not None:
            delta = self.detokenizer.step(self.output_token_ids)
            self.output_text, self.last_text_delta_len = self.detokenizer.text, len(delta)

    def add_prompt_logprobs(self, first: int, entries: list[dict]) -> None:
        """Log-probs of prompt positions ``first``, ``first + 1``, ...; those collected
        already (a recompute after preemption computes them again) are skipped."""
        for position, entry in enumerate(entries, start=first):
            if position + 1 == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, len={len(self)}, "
                f"computed={self.num_computed_tokens})")


@dataclass
class ScheduledBatch:
    """One step's work: ``seqs[i]`` computes ``num_tokens[i]`` tokens from its
    ``num_computed_tokens``. A prefill step may mix new and chunked prompts; a decode step
    computes exactly one token per sequence."""

    seqs: list[Sequence]
    num_tokens: list[int]
    is_prefill: bool

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class ForwardBatch:
    """Metadata of one step over ``B`` sequences and ``T`` new tokens.

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flattened ``[T, ...]`` activations and sit at absolute positions
    ``context_lens[i] .. seq_lens[i] - 1``. In a decode step ``T == B`` (one token each), and
    the batch may be padded up to a CUDA-graph size: a padded row holds one token at position
    0 (``seq_lens == 1``, ``context_lens == 0``) and names only each cache kind's padding
    unit (the padding block, the padding slot), which no sequence holds.

    ``caches`` holds each cache kind's own fields of the step, built by its pool
    (``CachePool.step_fields``) into the pool's ``batch_type``: a layer reads its kind's,
    e.g. ``batch.caches["paged_kv"].block_tables`` (``qllm.cache.paged_kv.PagedKVBatch``) or
    ``batch.caches["recurrent_slot"].slots`` (``qllm.cache.recurrent_slots
    .RecurrentSlotBatch``). A kind the model has no layer of has no entry.

    Host-side copies (``*_host``, ``max_*``) exist only for prefill, which runs eagerly;
    decode kernels must use the tensors alone so the step can be captured in a graph.
    """

    is_prefill: bool
    query_start_loc: torch.Tensor      # [B + 1] int32
    seq_lens: torch.Tensor             # [B] int32, tokens in the cache after this step
    context_lens: torch.Tensor         # [B] int32, tokens in the cache before this step
    logits_indices: torch.Tensor       # [N] int64, rows whose next token is sampled
    caches: dict[str, Any]             # cache kind -> its fields of this step (tensors)
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    max_query_len: int = 1
    max_seq_len: int = 0
    # the one device buffer that the tensors above (and the step's token ids and positions)
    # view, copied in once (``qllm.runner.staging``), and where each field lies in it; None
    # for a batch built another way
    staged: torch.Tensor | None = None
    staged_layout: Layout | None = None
    # prefill rows of media placeholders and what replaces their token embeddings (their
    # encoders' outputs, ``qllm.model.multimodal``); None in a step without media
    encoder_rows: torch.Tensor | None = None    # [M] int64
    encoder_embeds: torch.Tensor | None = None  # [M, H]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
