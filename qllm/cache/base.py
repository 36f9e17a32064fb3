"""What every cache kind offers the scheduler."""

from __future__ import annotations

import abc

import torch

from qllm.engine.sequence import Sequence
from qllm.specs import CacheRequirement


class CachePool(abc.ABC):
    """One cache kind's pool for one engine: storage for its layers plus per-sequence bookkeeping.

    ``layers`` are the modules that use this kind, each with a ``cache_requirement()``;
    ``attach`` hands each its storage once, so storage addresses never change afterwards.
    """

    name: str
    supports_prefix_caching: bool = False

    def __init__(self, layers: list, num_units: int, device: torch.device):
        self.layers = layers
        self.num_units = num_units
        self.device = device

    @staticmethod
    def requirements(layers: list) -> list[CacheRequirement]:
        return [layer.cache_requirement() for layer in layers]

    @abc.abstractmethod
    def admit(self, seq: Sequence) -> bool:
        """Take what a newly admitted sequence needs up front; False if there is no room."""

    @abc.abstractmethod
    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; False (no change) if none."""

    def register_computed(self, seq: Sequence) -> None:
        """Called after each step that computed tokens of ``seq``."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix that no sequence holds (for pools that keep them)."""

    @abc.abstractmethod
    def release(self, seq: Sequence) -> None:
        """Free everything ``seq`` holds (finish, abort or preemption)."""

    @property
    @abc.abstractmethod
    def num_free_units(self) -> int:
        """Units (blocks, slots) not held by any sequence."""

    def usage(self) -> float:
        """Fraction of the pool held by sequences, 0..1."""
        return 1.0 - self.num_free_units / max(self.num_units, 1)
