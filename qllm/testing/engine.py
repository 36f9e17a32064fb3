"""Checks on a running engine: every cache unit back in its pool, qllm's prefill logits,
token comparisons (exact, or up to numerical ties), and the CUDA-graph decode and prefill
paths replayed on the CPU."""

from __future__ import annotations

import contextlib

import torch

from qllm import SamplingParams
from qllm.batch import ScheduledBatch, Sequence


def assert_cache_free(llm) -> None:
    """Every block and slot of every cache pool is back in its free pool."""
    cache = llm.engine.cache
    assert cache.all_free(), f"cache leak: {cache.usage()}"
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@contextlib.contextmanager
def admitted(engine, prompt: list[int]):
    """A greedy sequence of ``prompt`` holding room for all of it in every cache pool, none of
    it cached (the prefix cache is emptied first); released on exit."""
    engine.cache.reset_prefix_cache()  # a cached prefix would leave only the tail to compute
    seq = Sequence(prompt, SamplingParams(temperature=0))
    assert engine.cache.admit(seq) == 0 and engine.cache.reserve(seq, len(prompt))
    try:
        yield seq
    finally:
        engine.cache.release(seq)


def prefill_logits(llm, prompt: list[int]) -> torch.Tensor:
    """qllm's logits ``[T, V]`` (as fp32) at every position of ``prompt`` in one prefill step,
    the layers run as they are."""
    engine = llm.engine
    with admitted(engine, prompt) as seq, torch.inference_mode():
        input_ids, positions, batch = engine.runner.prepare(
            ScheduledBatch([seq], [len(prompt)], is_prefill=True))
        hidden = engine.model(input_ids, positions, batch)
        return engine.model.compute_logits(hidden).float()


def last_token_logits(llm, prompt: list[int]) -> torch.Tensor:
    """qllm's logits ``[V]`` (as fp32) after ``prompt``'s one prefill step as the runner runs
    it: through the CUDA graph of its token bucket where prefill graphs are captured."""
    engine = llm.engine
    with admitted(engine, prompt) as seq:
        scheduled = ScheduledBatch([seq], [len(prompt)], is_prefill=True)
        return engine.runner.step_logits(scheduled)[0].float()


def record_launches(engine, monkeypatch) -> list[tuple[bool, int, int]]:
    """Record ``(is_prefill, sequences, tokens)`` of every batch ``engine``'s runner launches
    from now on (``monkeypatch``: pytest's fixture, which undoes it); returns the record."""
    launched, launch = [], engine.runner.launch

    def recording_launch(batch, previous=None, **options):
        launched.append((batch.is_prefill, len(batch.seqs), sum(batch.num_tokens)))
        return launch(batch, previous, **options)

    monkeypatch.setattr(engine.runner, "launch", recording_launch)
    return launched


class InjectedFailure(RuntimeError):
    """The failure ``fail_on_call`` injects."""


def fail_on_call(monkeypatch, owner, name: str, call: int,
                 error: type[Exception] = InjectedFailure) -> None:
    """Make ``owner.name`` raise ``error`` (an exception class taking a message) on its
    ``call``-th call from now on (counted from 1) and call through otherwise
    (``monkeypatch``: pytest's fixture, which undoes it)."""
    method, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            raise error(f"{name} failed (injected, call {call})")
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def assert_same_tokens(got: list[dict], expected: list[dict]) -> None:
    """Every output's token ids equal the expected ones; the message says where each of the
    differing outputs first diverges."""
    diverged = {}
    for i, (g, e) in enumerate(zip(got, expected)):
        pairs = list(zip(g["token_ids"], e["token_ids"]))
        first = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        if first is not None or len(g["token_ids"]) != len(e["token_ids"]):
            diverged[i] = first
    assert not diverged, (f"{len(diverged)} of {len(expected)} outputs differ; "
                          f"first differing token per output: {diverged}")


def assert_greedy_equal_up_to_ties(reference_llm, prompts: list[list[int]], got: list[dict],
                                   expected: list[dict], tolerance: float = 0.1) -> None:
    """Greedy outputs ``got`` equal ``expected`` (from ``reference_llm``) except where, at the
    first differing token, the two choices are a numerical tie by ``reference_llm``'s own
    logits: their gap is within ``tolerance`` standard deviations of those logits. Low
    precision reorders near-equal logits; a wrong cache slot or stale state does not produce
    ties."""
    ties, failures = [], []
    for i, (prompt, g, e) in enumerate(zip(prompts, got, expected)):
        first = next((j for j, (a, b) in enumerate(zip(g["token_ids"], e["token_ids"]))
                      if a != b), None)
        if first is None:
            assert g["token_ids"] == e["token_ids"]
            continue
        logits = prefill_logits(reference_llm, prompt + e["token_ids"][:first])[-1].float()
        gap = (logits[e["token_ids"][first]] - logits[g["token_ids"][first]]).item()
        entry = f"output {i} at token {first}: gap {gap:.4f} ({gap / logits.std():.3f} std)"
        (ties if gap <= tolerance * logits.std() else failures).append(entry)
    assert not failures, f"divergences that are not ties: {failures}; ties: {ties}"
    print(f"{len(prompts) - len(ties)} of {len(prompts)} outputs identical; ties: {ties}")


class RerunGraph:
    """Replays like a CUDA graph would: same static inputs in, same output tensor written."""

    def __init__(self, fn, output: torch.Tensor):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        self.output.copy_(self.fn())


def rerun_capture(fn):
    """A ``StepGraphs`` capture function: ``fn`` run once for its output, then rerun on
    each replay."""
    output = fn()
    return RerunGraph(fn, output), output


def record_replays(graphs) -> list[int]:
    """Record the bucket of every replay of ``graphs`` (a ``StepGraphs``) from now on;
    returns the record."""
    replayed, replay = [], graphs.replay

    def recording_replay(input_ids, positions, batch):
        replayed.append(input_ids.shape[0])
        return replay(input_ids, positions, batch)

    graphs.replay = recording_replay
    return replayed


def with_decode_graphs(llm, sizes: list[int]):
    """``llm`` with its runner's decode "graphs" for batch ``sizes`` captured by
    ``rerun_capture``, so CPU decode steps take the CUDA-graph path: padded to a bucket,
    staged in the fixed layout, copied into the bucket's static inputs."""
    runner = llm.engine.runner
    with torch.inference_mode():
        runner.graphs = runner.capture_graphs(False, sizes, rerun_capture)
    return llm


def with_prefill_graphs(llm, sizes: list[int]):
    """``llm`` with its runner's prefill "graphs" for token ``sizes`` captured by
    ``rerun_capture``, so a CPU prefill step of one sequence that completes its prompt takes
    the CUDA-graph path: padded with an inert row to a bucket, in the fixed layout."""
    runner = llm.engine.runner
    with torch.inference_mode():
        runner.prefill_graphs = runner.capture_graphs(True, sizes, rerun_capture)
    return llm
