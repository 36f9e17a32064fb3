"""The ``recurrent_slot`` cache kind: one fixed-size state slot per running sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.cache.base import CachePool, StepFields
from qllm.engine.sequence import Sequence


def bytes_per_slot(layers: list) -> int:
    """Memory of one sequence's state across every recurrent layer."""
    return sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


@dataclass
class RecurrentSlotBatch:
    """``recurrent_slot``'s fields of one step, ``ForwardBatch.caches["recurrent_slot"]``."""

    slots: torch.Tensor              # [B] int64, state slot per sequence (padded rows: padding)
    has_initial_state: torch.Tensor  # [B] bool, False where the state starts from zero


class RecurrentSlotPool(CachePool):
    """State slots shaped ``[num_slots + 1, ...]`` per layer (e.g. conv and SSM state).

    A slot is taken when a sequence is admitted and released when it finishes or is
    preempted. Slot ``num_slots`` (``padding_unit``) is the padding slot for CUDA-graph
    batches. A sequence's first step starts from zero state (kernels read
    ``RecurrentSlotBatch.has_initial_state``), so a reused slot never leaks its previous
    owner's state.
    """

    name = "recurrent_slot"
    supports_prefix_caching = False
    unit_name = "slot"
    batch_type = RecurrentSlotBatch

    def __init__(self, layers: list, num_units: int, device: torch.device):
        super().__init__(layers, num_units, device)
        self.free_slots = list(range(num_units - 1, -1, -1))
        self.slots: dict[int, int] = {}  # seq_id -> slot
        for layer, req in zip(layers, self.requirements(layers)):
            layer.attach_cache({
                key: torch.zeros((num_units + 1, *shape), dtype=req.dtypes[key], device=device)
                for key, shape in req.shapes.items()})

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

    def slot(self, seq: Sequence) -> int | None:
        """The slot ``seq`` holds, or None."""
        return self.slots.get(seq.seq_id)

    @property
    def num_free_units(self) -> int:
        return len(self.free_slots)

    def units_needed(self, num_tokens: int) -> int:
        return 1

    def step_fields(self, seqs: list[Sequence], context_lens: list[int], seq_lens: list[int],
                    num_padding: int = 0, max_model_len: int | None = None) -> StepFields:
        """``slots`` and ``has_initial_state``; see ``RecurrentSlotBatch``."""
        held = self.slots
        slots = [held[seq.seq_id] for seq in seqs] + [self.padding_unit] * num_padding
        has_initial_state = [start > 0 for start in context_lens] + [False] * num_padding
        return {"slots": (slots, torch.int64),
                "has_initial_state": (has_initial_state, torch.bool)}
