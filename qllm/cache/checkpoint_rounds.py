"""A prefill step's recurrent layers in rounds, so that states at checkpoint boundaries inside
the step's chunks can be saved (exact prefix caching of hybrid models, ``state_checkpoints``).

A recurrent layer's state exists only after its last token: the state after token ``b`` of a
chunk ``[start, end)`` is never materialised when the layer runs the chunk in one call. So
where a boundary ``b`` that needs a checkpoint falls inside a chunk (``start < b < end``), the
chunk is cut there into pieces, and the recurrent part of every such layer runs in rounds:
round ``r`` computes the ``r``-th piece of every sequence that has one, as a batch of its own
(from the state the round before left in the sequence's slot), then copies the slot's state
of each piece that ends at a boundary into that boundary's checkpoint row. A piece that ends
at its chunk's end saves there too. The rest of the step (projections, attention, MLPs) runs
over the whole step as usual, so the step computes what the same chunks cut into consecutive
steps would, at the cost of a few more recurrent-kernel launches per layer instead of a whole
step per cut.

Built on the host by ``RecurrentSlotPool.step_fields`` (prefill only); a step with rounds
runs eagerly, never as a captured graph (``CacheRegistry.needs_eager``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from qllm.batch import ForwardBatch


@dataclasses.dataclass
class Round:
    """One round: ``query_lens[j]`` tokens of piece ``j`` (positions ``context_lens[j] ..``),
    computed from slot ``slots[j]`` (its state read as zeros where ``has_state[j]`` is False),
    at step rows ``rows`` (piece after piece; None: the whole step, in order); after it, the
    state of slot ``save_slots[s]`` is copied to checkpoint row ``save_rows[s]``."""

    rows: list[int] | None
    query_lens: list[int]
    context_lens: list[int]
    slots: list[int]
    has_state: list[bool]
    save_slots: list[int]
    save_rows: list[int]

    @property
    def seq_lens(self) -> list[int]:
        """Each piece's end: ``context_lens[j] + query_lens[j]``."""
        return [c + n for c, n in zip(self.context_lens, self.query_lens)]


class CheckpointRounds:
    """The rounds of one prefill step (``Round``), shared by every recurrent layer of it; the
    device copy of each round's indices is made once, by the first layer that runs it."""

    def __init__(self, rounds: list[Round]):
        self.rounds = rounds
        self._device: dict[int, dict[str, torch.Tensor]] = {}

    def __getstate__(self) -> dict:  # sent to tensor-parallel workers without device copies
        return {"rounds": self.rounds, "_device": {}}

    @classmethod
    def plan(cls, slots: list[int], context_lens: list[int], seq_lens: list[int],
             has_state: list[bool], saves: list[list[tuple[int, int]]]) -> CheckpointRounds:
        """Rounds for sequences computing positions ``context_lens[i] .. seq_lens[i] - 1`` in
        slot ``slots[i]``, each saving its state after position ``b`` into row ``row`` for
        every ``(b, row)`` of ``saves[i]`` (ascending ``b``, ``context_lens[i] < b <=
        seq_lens[i]``). One round over the whole step when no save cuts a chunk."""
        pieces = []  # per sequence: [(first position, end, row to save at end or None)]
        for start, end, seq_saves in zip(context_lens, seq_lens, saves):
            cuts = [(b, row) for b, row in seq_saves if b < end]
            at_end = [row for b, row in seq_saves if b == end]
            bounds = [start] + [b for b, _ in cuts] + [end]
            rows = [row for _, row in cuts] + [at_end[0] if at_end else None]
            pieces.append(list(zip(bounds, bounds[1:], rows)))
        query_starts = [0]
        for start, end in zip(context_lens, seq_lens):
            query_starts.append(query_starts[-1] + end - start)
        single = all(len(p) == 1 for p in pieces)
        rounds = []
        for r in range(max(map(len, pieces), default=1)):
            members = [i for i, p in enumerate(pieces) if r < len(p)]
            spans = [pieces[i][r] for i in members]
            rows = None if single else [
                query_starts[i] + pos - context_lens[i]
                for i, (first, end, _) in zip(members, spans) for pos in range(first, end)]
            saved = [(slots[i], row) for i, (_, _, row) in zip(members, spans) if row is not None]
            rounds.append(Round(
                rows=rows, query_lens=[end - first for first, end, _ in spans],
                context_lens=[first for first, _, _ in spans], slots=[slots[i] for i in members],
                has_state=[has_state[i] or r > 0 for i in members],
                save_slots=[s for s, _ in saved], save_rows=[row for _, row in saved]))
        return cls(rounds)

    def run(self, fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            batch: ForwardBatch, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """``fn(*inputs, batch) -> out [T, ...]`` (per-token ``inputs [T, ...]``, reading and
        writing the recurrent ``states [S + 1, ...]`` at the batch's slots) round by round,
        each on its pieces' rows and a batch of its pieces; then each round's saves, in every
        tensor of ``states``. Returns ``out`` for the whole step, in its row order."""
        out = None
        for index, round_ in enumerate(self.rounds):
            device = self._device_round(index, batch.query_start_loc.device)
            sub_batch = dataclasses.replace(
                batch, query_start_loc=device["query_start_loc"], seq_lens=device["seq_lens"],
                context_lens=device["context_lens"], query_lens_host=round_.query_lens,
                seq_lens_host=round_.seq_lens,
                max_query_len=max(round_.query_lens),
                caches={**batch.caches, "recurrent_slot": dataclasses.replace(
                    batch.caches["recurrent_slot"], slots=device["slots"],
                    has_initial_state=device["has_state"], rounds=None)})
            if round_.rows is None:
                out = fn(*inputs, sub_batch)
            else:
                rows = device["rows"]  # a slice where consecutive (views, no gather)
                piece_out = fn(*(x[rows] for x in inputs), sub_batch)
                if out is None:
                    out = piece_out.new_empty((inputs[0].shape[0], *piece_out.shape[1:]))
                out[rows] = piece_out
            if round_.save_rows:
                for state in states:
                    state.index_copy_(0, device["save_rows"],
                                      state.index_select(0, device["save_slots"]))
        return out

    def _device_round(self, index: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Round ``index``'s indices on ``device``, copied over once (in one copy); its rows
        as a slice where they are consecutive (one piece, or pieces side by side)."""
        if index not in self._device:
            round_ = self.rounds[index]
            starts = [0]
            for n in round_.query_lens:
                starts.append(starts[-1] + n)
            rows = round_.rows or []
            consecutive = rows and rows[-1] - rows[0] == len(rows) - 1  # (rows ascend)
            parts = {"rows": [] if consecutive else rows, "query_start_loc": starts,
                     "seq_lens": round_.seq_lens, "context_lens": round_.context_lens,
                     "slots": round_.slots, "has_state": round_.has_state,
                     "save_slots": round_.save_slots, "save_rows": round_.save_rows}
            flat = torch.tensor([v for values in parts.values() for v in values],
                                dtype=torch.int64, pin_memory=device.type == "cuda")
            flat = flat.to(device, non_blocking=True)
            views, offset = {}, 0
            for name, values in parts.items():
                views[name] = flat[offset:offset + len(values)]
                offset += len(values)
            for name in ("query_start_loc", "seq_lens", "context_lens"):
                views[name] = views[name].to(torch.int32)
            views["has_state"] = views["has_state"].bool()
            if consecutive:
                views["rows"] = slice(rows[0], rows[-1] + 1)
            self._device[index] = views
        return self._device[index]
