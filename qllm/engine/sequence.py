"""One request's tokens and progress through the engine."""

from __future__ import annotations

import enum
import itertools

from qllm.config import SamplingParams


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
        # a request with media: its encoder inputs and rotary positions (qllm.multimodal)
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
