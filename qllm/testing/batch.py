"""``forward_batch``: a ``ForwardBatch`` from sequence lengths, for tests and benchmarks that
call ops or layers without an engine (the engine's runner builds its own, staged)."""

from __future__ import annotations

from typing import Any

import torch

from qllm.batch import ForwardBatch


def forward_batch(query_lens: list[int], context_lens: list[int] | None = None,
                  caches: dict[str, Any] | None = None,
                  device: str | torch.device = "cpu") -> ForwardBatch:
    """The step over sequences of ``query_lens`` new tokens after ``context_lens`` cached
    ones (default none): packed rows, lengths, host copies and each sequence's last row as
    its logits row; a decode step when every query length is 1. ``caches`` holds the cache
    kinds' fields (``PagedKVBatch``, ``RecurrentSlotBatch``...) already on ``device``."""
    context_lens = list(context_lens) if context_lens is not None else [0] * len(query_lens)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        is_prefill=max(query_lens) > 1,
        query_start_loc=ints(starts),                          # [B + 1]
        seq_lens=ints(seq_lens),                               # [B]
        context_lens=ints(context_lens),                       # [B]
        logits_indices=ints(starts[1:], torch.int64) - 1,      # [B]
        caches=dict(caches or {}),
        query_lens_host=list(query_lens),
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))


def recurrent_slot_batch(query_lens: list[int], slots: list[int], has_state: list[bool],
                         device: str | torch.device = "cpu") -> ForwardBatch:
    """``forward_batch`` with the ``recurrent_slot`` fields that the Gated DeltaNet ops read:
    sequence ``i`` in slot ``slots[i]``, starting from that slot's state when
    ``has_state[i]`` (else from zeros)."""
    from qllm.cache.recurrent_slots import RecurrentSlotBatch

    fields = RecurrentSlotBatch(
        slots=torch.tensor(slots, dtype=torch.int64, device=device),                 # [B]
        has_initial_state=torch.tensor(has_state, dtype=torch.bool, device=device))  # [B]
    return forward_batch(query_lens, caches={"recurrent_slot": fields}, device=device)
