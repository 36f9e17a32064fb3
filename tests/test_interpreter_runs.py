"""The kernel plugins' Triton-interpreter runs: started in the background for the collected
driver tests, each run once (by the worker or by its driver, whichever claims it first), its
failure raised in its driver test. The runs themselves are replaced by recorders here (runs
created before, such as the session's own, keep the real one)."""

from __future__ import annotations

import types

import pytest

from qllm.testing import kernels


@pytest.fixture
def recorded_runs(monkeypatch):
    """``(test_file, args)`` of each run, in order; a file named ``bad.py`` fails."""
    calls = []

    def run(test_file, *pytest_args):
        calls.append((test_file, pytest_args))
        assert test_file != "bad.py", "the interpreted tests of bad.py failed"

    monkeypatch.setattr(kernels, "_run_interpreted", run)
    monkeypatch.setattr(kernels, "_RUNS", {})
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    monkeypatch.setattr(kernels, "INTERPRETER_WORKS", True)
    return calls


def _driver_items(*runs: tuple) -> list:
    """Stand-ins for collected test items: drivers marked ``interpreter_run``, and another."""
    marks = [pytest.mark.interpreter_run(*run).mark for run in runs]
    items = [types.SimpleNamespace(get_closest_marker=lambda name, mark=mark: mark)
             for mark in marks]
    return items + [types.SimpleNamespace(get_closest_marker=lambda name: None)]


def test_background_runs_once_each_and_the_driver_gets_the_result(recorded_runs):
    workers = kernels.start_interpreter_runs(_driver_items(("a.py",), ("b.py", "-W", "ignore"),
                                                           ("c.py",)))
    assert len(workers) == kernels.INTERPRETER_WORKERS
    for worker in workers:
        worker.join()
    assert sorted(recorded_runs) == [("a.py", ()), ("b.py", ("-W", "ignore")), ("c.py", ())]
    kernels.run_interpreted_tests("a.py")  # done in the background: not run again
    kernels.run_interpreted_tests("b.py", "-W", "ignore")
    assert len(recorded_runs) == 3


def test_a_failed_run_fails_its_driver(recorded_runs):
    (worker,) = kernels.start_interpreter_runs(_driver_items(("bad.py",)))
    worker.join()
    with pytest.raises(AssertionError, match="bad.py failed"):
        kernels.run_interpreted_tests("bad.py")


def test_a_driver_without_a_background_run_runs_it_itself(recorded_runs):
    kernels.run_interpreted_tests("c.py")
    assert recorded_runs == [("c.py", ())]


def test_nothing_starts_inside_an_interpreter_run(recorded_runs, monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETING", True)
    assert kernels.start_interpreter_runs(_driver_items(("a.py",))) == []
    assert recorded_runs == []
