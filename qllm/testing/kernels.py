"""Shared scaffolding of the GPU-kernel test files: skip markers, the Triton-interpreter run
that checks the kernels on CPU tensors in a subprocess (``TRITON_INTERPRET`` must be set before
triton is imported), then compiles each of its kernel launches for the GPU
(``triton_launches``), and traced-graph inspection. The session starts the interpreter runs in
the background when it has collected their driver tests (the root ``conftest.py``), so on the
2-core CI machine they run beside the rest of the suite."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from qllm.testing import triton_launches

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Before 3.7 the interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses.
INTERPRETER_WORKS = HAS_TRITON and tuple(
    int(part) for part in importlib.metadata.version("triton").split(".")[:2]) >= (3, 7)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
interpreted = pytest.mark.skipif(not INTERPRETING,
                                 reason="runs inside test_triton_interpreter's subprocess")


def interpreter_driver(test_file: str, *pytest_args: str):
    """The test that runs ``test_file``'s ``interpreted`` tests under the Triton interpreter
    (``run_interpreted_tests`` with ``pytest_args``); in a test file,
    ``test_triton_interpreter = interpreter_driver(__file__)``. Marked ``interpreter_run``,
    so that a session starts it in the background as soon as it is collected
    (``start_interpreter_runs``); skipped inside that run and where the interpreter cannot
    work."""

    def test_triton_interpreter():
        run_interpreted_tests(test_file, *pytest_args)

    test_triton_interpreter.__doc__ = (f"The interpreted tests of {Path(test_file).name} on "
                                       f"the CPU, in a subprocess with the Triton interpreter.")
    test = pytest.mark.interpreter_run(test_file, *pytest_args)(test_triton_interpreter)
    test = pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run")(test)
    return pytest.mark.skipif(not INTERPRETER_WORKS,
                              reason="needs triton >= 3.7 for the interpreter")(test)


class _InterpretedRun:
    """One test file's interpreter run: started by the first of the background worker and its
    driver test to claim it; the driver test waits for it and raises its failure."""

    def __init__(self, test_file: str, pytest_args: tuple[str, ...], runner):
        self.test_file, self.pytest_args, self._runner = test_file, pytest_args, runner
        self._lock, self._done = threading.Lock(), threading.Event()
        self._claimed, self._error = False, None

    def claim(self) -> bool:
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def run(self) -> None:
        try:
            self._runner(self.test_file, *self.pytest_args)
        except Exception as error:  # noqa: BLE001 - raised again in the driver test
            self._error = error
        finally:
            self._done.set()

    def result(self) -> None:
        if self.claim():
            self.run()
        self._done.wait()
        if self._error is not None:
            raise self._error


_RUNS: dict[tuple, _InterpretedRun] = {}
_PROCESSES: set[subprocess.Popen] = set()
SUBPROCESS_TIMEOUT_S = 1800  # one stage of one file's run, with the suite running beside it
# Background runs at once. The runs are single-threaded; on the 2-core CI machine one worker
# left the MoE run (184 s) to its driver: 14 min 24 s for the suite, against ~20 serially.
INTERPRETER_WORKERS = 2


def _interpreted_run(test_file: str, pytest_args: tuple[str, ...]) -> _InterpretedRun:
    key = (test_file, pytest_args)
    if key not in _RUNS:
        _RUNS[key] = _InterpretedRun(test_file, pytest_args, _run_interpreted)
    return _RUNS[key]


def start_interpreter_runs(items: list[pytest.Item]) -> list[threading.Thread]:
    """Start the interpreter runs of the collected driver tests (marked ``interpreter_run``)
    in ``INTERPRETER_WORKERS`` background threads, each taking the next unclaimed run in
    collection order, while the session runs its other tests. Nothing inside an interpreter
    run or where the interpreter cannot work. Returns the threads."""
    if INTERPRETING or not INTERPRETER_WORKS:
        return []
    runs = [_interpreted_run(marker.args[0], tuple(marker.args[1:])) for item in items
            if (marker := item.get_closest_marker("interpreter_run")) is not None]

    def run_unclaimed():
        for run in runs:
            if run.claim():
                run.run()

    workers = [threading.Thread(target=run_unclaimed, name="qllm-interpreter-runs", daemon=True)
               for _ in range(min(INTERPRETER_WORKERS, len(runs)))]
    for worker in workers:
        worker.start()
    return workers


def stop_interpreter_runs() -> None:
    """Kill the interpreter runs' subprocesses still running (the session ends early)."""
    for process in list(_PROCESSES):
        process.kill()


def run_interpreted_tests(test_file: str, *pytest_args: str) -> None:
    """Run ``test_file``'s ``interpreted`` tests under the Triton interpreter; all must pass.
    Then every distinct kernel launch they made must compile for sm_90 (the interpreter
    accepts code the compiler rejects). Waits for the run where the session started it."""
    _interpreted_run(test_file, pytest_args).result()


def _subprocess(args: list[str], env: dict) -> tuple[int, str, str]:
    """``args`` run with ``env``: (exit status, stdout, stderr); killed by
    ``stop_interpreter_runs``."""
    process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    _PROCESSES.add(process)
    try:
        stdout, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += f"\nkilled after {SUBPROCESS_TIMEOUT_S} s: {' '.join(args)}"
    finally:
        _PROCESSES.discard(process)
    return process.returncode, stdout, stderr


def _run_interpreted(test_file: str, *pytest_args: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "launches.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", triton_launches.LOG_ENV: str(log),
               "PYTHONPATH": os.pathsep.join(sys.path)}
        status, stdout, stderr = _subprocess(
            [sys.executable, "-m", "pytest", test_file, "-q", "-k", "interpreted",
             "-p", "no:cacheprovider", *pytest_args], env)
        assert status == 0, stdout[-6000:] + stderr[-3000:]
        assert " passed" in stdout and " failed" not in stdout, stdout[-6000:]
        assert log.exists(), "the interpreted tests launched no qllm kernel"
        env = {key: value for key, value in env.items() if key != "TRITON_INTERPRET"}
        status, stdout, stderr = _subprocess(
            [sys.executable, "-m", triton_launches.__name__, str(log)], env)
        assert status == 0, stdout[-6000:] + stderr[-3000:]


def graphs_traced_by(run) -> list[torch.fx.GraphModule]:
    """Call ``run(backend)`` with a graph-recording ``torch.compile`` backend, then with
    ``aot_eager`` (dynamo reset before each); returns the graphs the recorder received."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for backend in (record, "aot_eager"):
        torch._dynamo.reset()
        run(backend)
    return graphs


def called_ops(graph: torch.fx.GraphModule) -> list:
    """The targets of a traced graph's function calls, in order."""
    return [node.target for node in graph.graph.nodes if node.op == "call_function"]


def assert_compiled_store_in_place(kv_store, stored_keys=lambda k: k) -> None:
    """``kv_store`` (``qllm.ops.attention.kv_store``'s signature), compiled inside a module
    holding two 512 MiB bf16 caches on the GPU, writes its rows into them, not into a copy:
    the step allocates under a sixteenth of a cache (a write through a view of the cache once
    made every compiled layer copy its whole cache twice per step). ``stored_keys(k)``: the
    rows a store that transforms its keys writes for 64 keys ``k [64, 8, 128]``."""

    class Store(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shape = (16384, 16, 8, 128)  # [pages, page size, kv heads, head dim]
            self.k_cache, self.v_cache = (torch.zeros(shape, dtype=torch.bfloat16,
                                                      device="cuda") for _ in range(2))

        def forward(self, k, v, slot_mapping):
            kv_store(self.k_cache, self.v_cache, k * 2, v, slot_mapping)

    store = Store()
    store.compile(dynamic=True, fullgraph=True)
    k, v = (torch.randn(64, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    slots = torch.randperm(16384 * 16, device="cuda")[:64]
    store(k, v, slots)  # compiles
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    store(k, -v, slots)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - baseline < store.k_cache.nbytes // 16
    flat_k, flat_v = (c.view(-1, 8, 128) for c in (store.k_cache, store.v_cache))
    assert torch.equal(flat_k[slots], stored_keys(k * 2)) and torch.equal(flat_v[slots], -v)
