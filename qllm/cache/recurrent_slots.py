"""The ``recurrent_slot`` cache kind: one fixed-size state slot per running sequence."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qllm.batch import Sequence
from qllm.cache.base import CachePool, StepFields
from qllm.cache.checkpoint_rounds import CheckpointRounds
from qllm.cache.state_checkpoints import StateCheckpoints

logger = logging.getLogger(__name__)


DEFAULT_CHECKPOINT_BYTES = 1 << 30  # what the default prefix-state checkpoints may take
DEFAULT_CHECKPOINTS = 32  # and how many at most


def bytes_per_slot(layers: list) -> int:
    """Memory of one sequence's state across every recurrent layer."""
    return sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


def default_state_checkpoints(checkpoint_bytes: int) -> int:
    """Prefix-state checkpoints kept by default when each takes ``checkpoint_bytes``: as many
    as 1 GiB holds, at most 32, at least one (16 fp32 states of Qwen3.5-35B-A3B, 32 bf16;
    ``EngineConfig.prefix_state_cache_slots`` unset)."""
    return max(1, min(DEFAULT_CHECKPOINTS, DEFAULT_CHECKPOINT_BYTES // max(checkpoint_bytes, 1)))


@dataclass
class RecurrentSlotBatch:
    """``recurrent_slot``'s fields of one step, ``ForwardBatch.caches["recurrent_slot"]``."""

    slots: torch.Tensor              # [B] int64, state slot per sequence (padded rows: padding)
    has_initial_state: torch.Tensor  # [B] bool, False where the state starts from zero
    # prefill: where the step's recurrent layers save states at checkpoint boundaries (run
    # their recurrence through ``rounds.run``); None when the step saves none
    rounds: CheckpointRounds | None = None


class RecurrentSlotPool(CachePool):
    """State slots shaped ``[num_slots + 1 + num_checkpoints, ...]`` per layer (e.g. conv and
    SSM state).

    A slot is taken when a sequence is admitted and released when it finishes or is
    preempted. Slot ``num_slots`` (``padding_unit``) is the padding slot for CUDA-graph
    batches. A sequence's first step starts from zero state (kernels read
    ``RecurrentSlotBatch.has_initial_state``), so a reused slot never leaks its previous
    owner's state.

    With ``num_checkpoints`` rows after the padding slot, prefix caching is exact
    (``state_checkpoints``): where a prefill step passes a sequence's branch point (the end of
    a shared KV prefix that no checkpoint covered at its admission) and no checkpoint is there
    yet, the step gets a row for it and the recurrent layers save their state there as they
    pass it (``RecurrentSlotBatch.rounds``, ``checkpoint_rounds``; such a step runs
    eagerly, ``needs_eager``); an admitted sequence whose cached KV prefix reaches a
    checkpoint starts from a copy of it in its own slot (``take_prefix``). A checkpoint is
    written once, by the step that passes it. Copies are device copies in stream order.
    """

    name = "recurrent_slot"
    supports_prefix_caching = False
    unit_name = "slot"
    batch_type = RecurrentSlotBatch

    def __init__(self, layers: list, num_units: int, device: torch.device,
                 num_checkpoints: int = 0, block_size: int = 256):
        super().__init__(layers, num_units, device)
        self.free_slots = list(range(num_units - 1, -1, -1))
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.storage: list[torch.Tensor] = []  # every state tensor, rows first
        for layer, req in zip(layers, self.requirements(layers)):
            tensors = {key: torch.zeros((num_units + 1 + num_checkpoints, *shape),
                                        dtype=req.dtypes[key], device=device)
                       for key, shape in req.shapes.items()}
            self.storage += tensors.values()
            layer.attach_cache(tensors)
        self.supports_prefix_caching = num_checkpoints > 0
        if num_checkpoints:
            row_bytes = bytes_per_slot(layers)
            logger.info("prefix cache: %d recurrent-state checkpoints (prefix_state_cache_slots)"
                        " of %.2f MiB each, %.1f MiB", num_checkpoints, row_bytes / 2**20,
                        num_checkpoints * row_bytes / 2**20)
        self.checkpoints = StateCheckpoints(num_units + 1, num_checkpoints, block_size)
        self.prefix_caching = False

    def set_prefix_caching(self, enabled: bool) -> None:
        self.prefix_caching = enabled and self.supports_prefix_caching

    def reset_prefix_cache(self) -> None:
        self.checkpoints.clear()

    def longest_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """The longest block boundary up to ``num_tokens`` with a state checkpoint."""
        if not self.prefix_caching:
            return 0
        bs = self.checkpoints.block_size
        for end in range(num_tokens // bs * bs, 0, -bs):
            if self.checkpoints.find(seq, end) is not None:
                return end
        return 0

    def take_prefix(self, seq: Sequence, num_tokens: int, cached_tokens: int) -> None:
        """Copy the checkpoint after ``num_tokens`` tokens into ``seq``'s slot; where the KV
        cache holds more (``cached_tokens``), the prefix up to there is shared: ``seq`` keeps
        a checkpoint there as it recomputes it (``StateCheckpoints.want``)."""
        if self.prefix_caching and cached_tokens > num_tokens:
            self.checkpoints.want(seq, cached_tokens)
        if num_tokens == 0:
            return
        row = self.checkpoints.find(seq, num_tokens)
        assert row is not None, f"{seq}: no state checkpoint after {num_tokens} tokens"
        self.checkpoints.touch(seq, num_tokens)
        self.checkpoints.num_restored += 1
        self._copy([row], [self.slots[seq.seq_id]])

    def awaits_prefix(self, seq: Sequence, num_tokens: int, cached_tokens: int) -> bool:
        """Whether another running sequence will save the checkpoint at ``seq``'s branch
        point (``cached_tokens``) before long (``StateCheckpoints.pending``)."""
        return self.checkpoints.pending(seq, cached_tokens)

    def forget_prefix(self, block_hash: int) -> None:
        self.checkpoints.forget(block_hash)

    def needs_eager(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether computing ``seq``'s next ``num_tokens`` prefill tokens saves a checkpoint
        (which a captured graph would not)."""
        return bool(self._saves(seq, seq.num_computed_tokens, seq.num_computed_tokens
                                + num_tokens, claim=False))

    def _saves(self, seq: Sequence, start: int, end: int, claim: bool) -> list[tuple[int, int]]:
        """``[(b, row)]`` for ``seq``'s branch point ``b`` if it lies in ``(start, end]`` with
        no checkpoint yet (``[]`` otherwise); with ``claim``, ``row`` is the row claimed for
        it (``StateCheckpoints.add``), else -1."""
        b = self.checkpoints.wanted(seq) if self.prefix_caching else None
        if b is None or not start < b <= end or self.checkpoints.find(seq, b) is not None:
            return []
        return [(b, self.checkpoints.add(seq, b) if claim else -1)]

    @torch.no_grad()
    def _copy(self, sources: list[int], targets: list[int]) -> None:
        """Rows ``sources`` -> rows ``targets`` of every state tensor, in stream order."""
        pin = self.device.type == "cuda"
        src, dst = torch.tensor([sources, targets], dtype=torch.int64,
                                pin_memory=pin).to(self.device, non_blocking=True)
        for tensor in self.storage:
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def prefix_stats(self) -> dict[str, int]:
        """Counters of the state checkpoints (for ``/metrics``)."""
        cp = self.checkpoints
        return {"state_checkpoints": len(cp.entries), "state_checkpoint_capacity": cp.num_rows,
                "state_checkpoints_saved": cp.num_saved,
                "state_checkpoints_restored": cp.num_restored,
                "state_checkpoints_evicted": cp.num_evicted}

    def admit(self, seq: Sequence) -> bool:
        if not self.free_slots:
            return False
        self.slots[seq.seq_id] = self.free_slots.pop()
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        return True  # a slot's size does not grow with the sequence

    def release(self, seq: Sequence) -> None:
        slot = self.slots.pop(seq.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.checkpoints.forget_sequence(seq)

    def slot(self, seq: Sequence) -> int | None:
        """The slot ``seq`` holds, or None."""
        return self.slots.get(seq.seq_id)

    @property
    def num_free_units(self) -> int:
        return len(self.free_slots)

    def units_needed(self, num_tokens: int) -> int:
        return 1

    def step_fields(self, seqs: list[Sequence], context_lens: list[int], seq_lens: list[int],
                    num_padding: int = 0, max_model_len: int | None = None,
                    padding_len: int = 1, is_prefill: bool = False) -> StepFields:
        """``slots``, ``has_initial_state`` and, in a prefill step that passes checkpoint
        boundaries with none yet, ``rounds`` (each boundary's row claimed here); see
        ``RecurrentSlotBatch``."""
        held = self.slots
        slots = [held[seq.seq_id] for seq in seqs] + [self.padding_unit] * num_padding
        has_initial_state = [start > 0 for start in context_lens] + [False] * num_padding
        fields = {"slots": (slots, torch.int64),
                  "has_initial_state": (has_initial_state, torch.bool)}
        if is_prefill and self.prefix_caching:
            saves = [self._saves(seq, start, end, claim=True)
                     for seq, start, end in zip(seqs, context_lens, seq_lens)]
            if any(saves):
                # a row claimed twice in this step (evicted for a later boundary) keeps the
                # later save alone: one step never writes a row twice
                last = {row: (i, b) for i, seq_saves in enumerate(saves) for b, row in seq_saves}
                saves = [[(b, row) for b, row in seq_saves if last[row] == (i, b)]
                         for i, seq_saves in enumerate(saves)]
                rounds = CheckpointRounds.plan(slots, context_lens, seq_lens,
                                               has_initial_state, saves)
                fields["rounds"] = (rounds, None)
        return fields
