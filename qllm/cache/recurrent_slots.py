"""The ``recurrent_slot`` cache kind: one fixed-size state slot per running sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.batch import Sequence
from qllm.cache.base import CachePool, StepFields
from qllm.cache.state_checkpoints import StateCheckpoints


def bytes_per_slot(layers: list) -> int:
    """Memory of one sequence's state across every recurrent layer."""
    return sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


@dataclass
class RecurrentSlotBatch:
    """``recurrent_slot``'s fields of one step, ``ForwardBatch.caches["recurrent_slot"]``."""

    slots: torch.Tensor              # [B] int64, state slot per sequence (padded rows: padding)
    has_initial_state: torch.Tensor  # [B] bool, False where the state starts from zero


class RecurrentSlotPool(CachePool):
    """State slots shaped ``[num_slots + 1 + num_checkpoints, ...]`` per layer (e.g. conv and
    SSM state).

    A slot is taken when a sequence is admitted and released when it finishes or is
    preempted. Slot ``num_slots`` (``padding_unit``) is the padding slot for CUDA-graph
    batches. A sequence's first step starts from zero state (kernels read
    ``RecurrentSlotBatch.has_initial_state``), so a reused slot never leaks its previous
    owner's state.

    With ``num_checkpoints`` rows after the padding slot, prefix caching is exact
    (``state_checkpoints``): a prefill chunk stops at each checkpoint boundary that has no
    checkpoint yet (``limit_chunk``), the state in the slot is then copied to a checkpoint
    row (``step_launched``), and an admitted sequence whose cached KV prefix reaches a
    checkpoint starts from a copy of it in its own slot (``take_prefix``); the checkpoint
    itself is never written by a step. Copies are device copies in stream order (outside
    CUDA graphs: prefill steps and admission run eagerly).
    """

    name = "recurrent_slot"
    supports_prefix_caching = False
    unit_name = "slot"
    batch_type = RecurrentSlotBatch

    def __init__(self, layers: list, num_units: int, device: torch.device,
                 num_checkpoints: int = 0, block_size: int = 256, interval_blocks: int = 1):
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
        self.checkpoints = StateCheckpoints(num_units + 1, num_checkpoints, block_size,
                                            interval_blocks)
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

    def take_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """Copy the checkpoint after ``num_tokens`` tokens into ``seq``'s slot."""
        if num_tokens == 0:
            return
        row = self.checkpoints.find(seq, num_tokens)
        assert row is not None, f"{seq}: no state checkpoint after {num_tokens} tokens"
        self.checkpoints.touch(seq, num_tokens)
        self.checkpoints.num_restored += 1
        self._copy([row], [self.slots[seq.seq_id]])

    def forget_prefix(self, block_hash: int) -> None:
        self.checkpoints.forget(block_hash)

    def limit_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """Stop the chunk at the first checkpoint boundary inside it that has none yet."""
        if not self.prefix_caching:
            return num_tokens
        start = seq.num_computed_tokens
        bs = self.checkpoints.block_size
        for end in range((start // bs + 1) * bs, start + num_tokens, bs):
            if not self.checkpoints.is_boundary(seq, end):
                continue
            if self.checkpoints.find(seq, end) is None:
                return end - start
        return num_tokens

    def step_launched(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Save the state of each sequence whose prefill chunk ended at a boundary."""
        if not (self.prefix_caching and is_prefill):
            return
        sources, rows = [], []
        for seq in seqs:
            end = seq.num_computed_tokens
            if self.checkpoints.is_boundary(seq, end):
                row = self.checkpoints.add(seq, end)
                if row is not None:
                    sources.append(self.slots[seq.seq_id])
                    rows.append(row)
        if rows:
            self._copy(sources, rows)

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
                    padding_len: int = 1) -> StepFields:
        """``slots`` and ``has_initial_state``; see ``RecurrentSlotBatch``."""
        held = self.slots
        slots = [held[seq.seq_id] for seq in seqs] + [self.padding_unit] * num_padding
        has_initial_state = [start > 0 for start in context_lens] + [False] * num_padding
        return {"slots": (slots, torch.int64),
                "has_initial_state": (has_initial_state, torch.bool)}
