"""The ``recurrent_slot`` cache kind: one fixed-size state slot per running sequence."""

from __future__ import annotations

import torch

from qllm.cache.base import CachePool
from qllm.engine.sequence import Sequence


def bytes_per_slot(layers: list) -> int:
    """Memory of one sequence's state across every recurrent layer."""
    return sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


class RecurrentSlotPool(CachePool):
    """State slots shaped ``[num_slots + 1, ...]`` per layer (e.g. conv and SSM state).

    A slot is taken when a sequence is admitted and released when it finishes or is
    preempted. Slot ``num_slots`` is the padding slot for CUDA-graph batches. A sequence's
    first step starts from zero state (kernels read ``ForwardBatch.has_initial_state``), so a
    reused slot never leaks its previous owner's state.
    """

    name = "recurrent_slot"
    supports_prefix_caching = False

    def __init__(self, layers: list, num_units: int, device: torch.device):
        super().__init__(layers, num_units, device)
        self.padding_slot = num_units
        self.free_slots = list(range(num_units - 1, -1, -1))
        for layer, req in zip(layers, self.requirements(layers)):
            layer.attach_cache({
                key: torch.zeros((num_units + 1, *shape), dtype=req.dtypes[key], device=device)
                for key, shape in req.shapes.items()})

    def admit(self, seq: Sequence) -> bool:
        if not self.free_slots:
            return False
        seq.recurrent_slot = self.free_slots.pop()
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        return True  # a slot's size does not grow with the sequence

    def release(self, seq: Sequence) -> None:
        if seq.recurrent_slot is not None:
            self.free_slots.append(seq.recurrent_slot)
            seq.recurrent_slot = None

    @property
    def num_free_units(self) -> int:
        return len(self.free_slots)
