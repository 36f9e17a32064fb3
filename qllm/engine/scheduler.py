"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque

from qllm.batch import ScheduledBatch, Sequence, SequenceStatus
from qllm.cache.registry import CacheRegistry
from qllm.config import EngineConfig
from qllm.engine.stop import check_stop, reaches_length_limit


class Scheduler:
    """FCFS scheduler with chunked prefill and preemption by recompute; the one owner of each
    sequence's lifecycle (waiting -> running -> finished, or back to waiting when preempted;
    its computed, cached and pending token counts).

    Each step is a prefill step when some prompt still needs computing and fits, otherwise a
    decode step over every running sequence. When the cache cannot grow a running sequence,
    the most recently admitted sequence is preempted: its cache is freed and it returns to the
    head of the queue, to be recomputed (prompt plus generated tokens) when there is room.

    A step is ``schedule`` (the batch), then, once the batch is queued on the device,
    ``launched``, and once its sampled tokens are on the host, ``postprocess``. With
    asynchronous scheduling the next ``schedule`` and ``launched`` come before this
    ``postprocess``: a sequence then has a token pending.
    """

    def __init__(self, config: EngineConfig, cache: CacheRegistry):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = config.max_model_len
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs, counts = [], []
        budget = self.max_num_batched_tokens
        # Prompts admitted but only partly computed (chunked prefill) continue first.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status == SequenceStatus.RUNNING and seq.num_uncomputed_tokens > 1:
                n = min(seq.num_uncomputed_tokens, budget)
                if self._reserve_or_preempt(seq, n):
                    seqs.append(seq)
                    counts.append(n)
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted with a token still on its way: next step
                break
            num_cached = self.cache.admit(seq)
            if num_cached is None:
                break
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            n = seq.num_uncomputed_tokens
            if n > budget and not self.chunked_prefill and seqs:
                self._release(seq)  # the whole prompt goes in a later step
                break
            n = min(n, budget) if self.chunked_prefill else n
            if not self.cache.reserve(seq, n):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled = [seq for seq in list(self.running)
                     if seq.status == SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
                     and not self._finishes_by_length(seq)
                     and self._reserve_or_preempt(seq, 1)]
        return ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False) \
            if scheduled else None

    def _finishes_by_length(self, seq: Sequence) -> bool:
        """Whether ``seq`` stops on ``max_tokens`` or ``max_model_len`` once its pending
        tokens land, so another step for it would be wasted."""
        return bool(seq.num_pending_tokens) and reaches_length_limit(
            seq, self.max_model_len, seq.num_pending_tokens)

    def _reserve_or_preempt(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Reserve room for ``seq``, preempting the latest-admitted running sequences while
        that is needed. If ``seq`` is itself the latest, it is preempted and False returned."""
        while not self.cache.reserve(seq, num_new_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free all of ``seq``'s cache: none of its tokens count as computed any more."""
        self.cache.release(seq)
        seq.num_computed_tokens = 0

    def launched(self, batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """``batch`` is queued on the device: its tokens count as computed (the next batch
        builds on them), and each of ``sampled`` (the sequences it samples a token for) has a
        token pending."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        for seq in sampled:
            seq.num_pending_tokens += 1

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                    eos_token_ids: set[int], logprobs: list[dict | None] | None = None
                    ) -> list[Sequence]:
        """The tokens of a launched ``batch`` reached the host: ``tokens[i]`` (with its
        ``logprobs[i]``, when given) is the pending token of ``sampled[i]``. Appends each,
        finishes the sequences that stop on it (``check_stop``), and hands the cache what
        the batch computed (the paged KV cache registers full blocks for prefix caching). A
        sequence finished while the batch ran (stopped on an earlier token, or aborted) drops
        its token. Returns the sequences that got a token, those finished now included."""
        advanced = []
        for i, (seq, token) in enumerate(zip(sampled, tokens)):
            seq.num_pending_tokens -= 1
            if seq.is_finished:
                continue
            seq.append_token(token, None if logprobs is None else logprobs[i])
            reason = check_stop(seq, eos_token_ids, self.max_model_len)
            if reason is not None:
                self.finish(seq, reason)
            advanced.append(seq)
        for seq in batch.seqs:
            if seq.status == SequenceStatus.RUNNING:
                self.cache.register_computed(seq)
        return advanced

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (stop condition or abort) and free its cache, first handing the
        cache what it computed (a request that stops on its first token, as one of
        ``max_tokens=1`` does, leaves its prompt's full blocks cached for later prompts)."""
        if seq.status == SequenceStatus.RUNNING:
            self.cache.register_computed(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
