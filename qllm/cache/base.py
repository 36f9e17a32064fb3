"""What every cache kind offers the scheduler and the model runner."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from qllm.batch import Sequence

# a step's fields of one cache kind, as ``qllm.runner.staging.stage`` takes them:
# name -> (values, dtype), values a flat list or a list of equal-length lists
StepFields = dict[str, tuple[list, torch.dtype]]


@dataclass(frozen=True)
class CacheRequirement:
    """What one layer needs from its cache kind, per unit of that kind.

    For ``full_attention``: one entry per token, ``{"k": (kv_heads, head_dim), "v": ...}``.
    For ``linear_attention``: one entry per sequence slot, ``{"conv": ..., "ssm": ...}``.
    """

    layer_kind: str
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    def bytes_per_entry(self) -> int:
        total = 0
        for key, shape in self.shapes.items():
            numel = 1
            for size in shape:
                numel *= size
            total += numel * self.dtypes[key].itemsize
        return total


class CacheTooSmallError(RuntimeError):
    """The memory budget cannot hold even one sequence of ``max_model_len`` tokens."""


class CachePool(abc.ABC):
    """One cache kind's pool for one engine: storage for its layers plus per-sequence bookkeeping.

    ``layers`` are the modules that use this kind, each with a ``cache_requirement()``;
    ``attach`` hands each its storage once, so storage addresses never change afterwards.

    The pool owns everything about its kind that the rest of the engine must not guess:

    - which units each sequence holds (the pool keeps that, keyed by ``seq.seq_id``);
    - the step's batch fields its layers read (``step_fields``), and the ``batch_type`` that
      carries them to the model as ``ForwardBatch.caches[name]``;
    - an inert ``padding_unit`` that no sequence ever holds, for the padded rows of a
      CUDA-graph batch (they run the model too, and write to whatever unit they name);
    - whether one sequence of ``max_model_len`` tokens fits at all (``check_capacity``).
    """

    name: str
    supports_prefix_caching: bool = False
    unit_name: str = "unit"  # what one unit is called in messages ("block", "slot")
    # the dataclass carrying the fields of ``step_fields`` (same names) to the model
    batch_type: type

    def __init__(self, layers: list, num_units: int, device: torch.device):
        self.layers = layers
        self.num_units = num_units
        self.device = device
        # units are 0 .. num_units - 1; storage holds one more, which belongs to nobody
        self.padding_unit = num_units

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

    def set_prefix_caching(self, enabled: bool) -> None:
        """Called once by the registry: prefix caching is on only when every pool of the
        engine supports it (for pools that keep prefixes)."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix that no sequence holds (for pools that keep them)."""

    # Prefix caching across pools: at admission each pool first takes what it has of the
    # sequence's cached prefix (``admit``; ``paged_kv`` takes its cached blocks and reports
    # their tokens, ``cached_prefix_len``), then the registry asks every pool how much of the
    # longest of those it can serve (``longest_prefix``) and settles on the shortest answer
    # (``take_prefix``), unless a pool would rather the sequence wait for another one to
    # make more of it servable (``awaits_prefix``); the scheduler starts the sequence there.
    on_forget_prefix = None  # set by the registry: call with a block hash no pool may keep

    def cached_prefix_len(self, seq: Sequence) -> int:
        """How many of ``seq``'s first tokens ``admit`` just took from this pool's prefix
        cache (a block boundary); 0 for a pool that takes none at admission."""
        return 0

    def longest_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """The longest cached prefix of ``seq``, at most ``num_tokens`` tokens (a block
        boundary), that this pool can serve too."""
        return num_tokens

    def take_prefix(self, seq: Sequence, num_tokens: int, cached_tokens: int) -> None:
        """``seq`` starts from its first ``num_tokens`` tokens (the registry's settled
        prefix): give back what was taken beyond it, fill in what this pool restores.
        ``cached_tokens`` (>= ``num_tokens``) is the longest prefix some pool had cached: the
        tokens between are a prefix shared with earlier sequences, recomputed."""

    def awaits_prefix(self, seq: Sequence, num_tokens: int, cached_tokens: int) -> bool:
        """Whether ``seq``, which would start from its first ``num_tokens`` tokens and
        recompute the cached ones up to ``cached_tokens``, had better wait: another running
        sequence is about to keep what this pool would need to serve them (a recurrent-state
        checkpoint). The registry then admits ``seq`` in a later step."""
        return False

    def forget_prefix(self, block_hash: int) -> None:
        """The prefix ending with the block of hash ``block_hash`` is no longer cached."""

    def needs_eager(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a prefill step computing ``seq``'s next ``num_tokens`` tokens must run
        eagerly, not as a captured graph (e.g. its layers save state as they go)."""
        return False

    @abc.abstractmethod
    def release(self, seq: Sequence) -> None:
        """Free everything ``seq`` holds (finish, abort or preemption); a no-op for a
        sequence that holds nothing here."""

    @property
    @abc.abstractmethod
    def num_free_units(self) -> int:
        """Units (blocks, slots) not held by any sequence."""

    @abc.abstractmethod
    def units_needed(self, num_tokens: int) -> int:
        """Units one sequence of ``num_tokens`` tokens holds."""

    def check_capacity(self, max_model_len: int) -> None:
        """Raise ``CacheTooSmallError`` unless one sequence of ``max_model_len`` tokens fits.
        Called by the registry for every pool once it is built."""
        needed = self.units_needed(max_model_len)
        if needed > self.num_units:
            raise CacheTooSmallError(
                f"the {self.name} cache holds {self.num_units} {self.unit_name}s, fewer than "
                f"the {needed} that one sequence of max_model_len={max_model_len} needs; "
                f"lower max_model_len or give the cache more memory")

    @abc.abstractmethod
    def step_fields(self, seqs: list[Sequence], context_lens: list[int], seq_lens: list[int],
                    num_padding: int = 0, max_model_len: int | None = None,
                    padding_len: int = 1, is_prefill: bool = False) -> StepFields:
        """This kind's batch fields of one step (a prefill step if ``is_prefill``), staged
        by the runner with the common ones.

        Sequence ``seqs[i]`` computes positions ``context_lens[i] .. seq_lens[i] - 1``; its
        units are reserved. Then ``num_padding`` inert rows follow (a CUDA-graph bucket's):
        ``padding_len`` tokens each (one in decode; any number, even none, in prefill) at
        positions ``0 .. padding_len - 1``, which must name only ``padding_unit``. Per-token
        fields follow the tokens in order.

        With ``max_model_len`` the fields take the fixed shapes of a CUDA graph's static
        inputs, sized for sequences of up to that many tokens (e.g. block tables that wide),
        so every step of a bucket lays out alike; without it they may be sized for this
        step alone. Names, their order and dtypes must never depend on the step, except a
        field given as ``(value, None)``: a host object handed to the batch type as it is,
        not staged, in an eager step only (one for which ``needs_eager`` said so).
        """

    def usage(self) -> float:
        """Fraction of the pool held by sequences, 0..1."""
        return 1.0 - self.num_free_units / max(self.num_units, 1)
