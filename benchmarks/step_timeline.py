"""The engine's steps as a benchmark sees them: kind, size and wall time of each."""

from __future__ import annotations

import time


class StepTimeline:
    """Records the engine's steps from now on: the kind of batch each launched (prefill,
    decode, or none while the last tokens land), its size and the step's wall time. With
    async scheduling a step's wall time also covers the wait for the step before it, so the
    split by kind is approximate at the boundaries between phases (a compile at a batch's
    launch still counts in that batch's step)."""

    def __init__(self, engine):
        self.rows: list[tuple[str, int, int, float]] = []  # (kind, seqs, tokens, seconds)
        schedule, step = engine.scheduler.schedule, engine.step
        launched = []

        def recording_schedule():
            launched.append(schedule())
            return launched[-1]

        def timed_step():
            launched.clear()
            start = time.perf_counter()
            advanced = step()
            batch = launched[0] if launched else None
            kind = "none" if batch is None else "prefill" if batch.is_prefill else "decode"
            self.rows.append((kind, len(batch.seqs) if batch else 0,
                              sum(batch.num_tokens) if batch else 0,
                              time.perf_counter() - start))
            return advanced

        self._engine, self._originals = engine, (schedule, step)
        engine.scheduler.schedule, engine.step = recording_schedule, timed_step

    def stop(self) -> None:
        """Stop recording: the engine's own ``schedule`` and ``step`` again."""
        self._engine.scheduler.schedule, self._engine.step = self._originals

    def summary(self) -> dict:
        """Per kind: steps, seconds, tokens; for prefill also each step's seconds, sequences
        and tokens (a slow step shows a compile the warm-up missed, and its shape which one);
        for decode the mean batch and the time spent in steps of under 64 sequences (the
        tail of a run)."""
        out = {}
        for kind in ("prefill", "decode", "none"):
            rows = [r for r in self.rows if r[0] == kind]
            if rows:
                out[kind] = {"steps": len(rows), "seconds": round(sum(r[3] for r in rows), 3),
                             "tokens": sum(r[2] for r in rows)}
        prefill = [r for r in self.rows if r[0] == "prefill"]
        if prefill:
            out["prefill"]["step_seconds"] = [round(r[3], 3) for r in prefill]
            out["prefill"]["step_seqs"] = [r[1] for r in prefill]
            out["prefill"]["step_tokens"] = [r[2] for r in prefill]
        decode = [r for r in self.rows if r[0] == "decode"]
        if decode:
            out["decode"]["mean_batch"] = round(sum(r[1] for r in decode) / len(decode), 1)
            out["decode"]["seconds_under_64_seqs"] = round(
                sum(r[3] for r in decode if r[1] < 64), 3)
        return out
