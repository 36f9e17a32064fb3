"""Shared scaffolding of the GPU-kernel test files: skip markers, the Triton-interpreter run
that checks the kernels on CPU tensors in a subprocess (``TRITON_INTERPRET`` must be set before
triton is imported), then compiles each of its kernel launches for the GPU
(``triton_launches``), and traced-graph inspection."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
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


def interpreter_driver(test):
    """Marks the test that starts the interpreter run: skipped inside that run and where the
    interpreter cannot work."""
    test = pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run")(test)
    return pytest.mark.skipif(not INTERPRETER_WORKS,
                              reason="needs triton >= 3.7 for the interpreter")(test)


def run_interpreted_tests(test_file: str, *pytest_args: str) -> None:
    """Run ``test_file``'s ``interpreted`` tests under the Triton interpreter; all must pass.
    Then every distinct kernel launch they made must compile for sm_90 (the interpreter
    accepts code the compiler rejects)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "launches.jsonl"
        env = {**os.environ, "TRITON_INTERPRET": "1", triton_launches.LOG_ENV: str(log),
               "PYTHONPATH": os.pathsep.join(sys.path)}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", test_file, "-q", "-k", "interpreted",
             "-p", "no:cacheprovider", *pytest_args],
            env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        assert " passed" in result.stdout and " failed" not in result.stdout
        assert log.exists(), "the interpreted tests launched no qllm kernel"
        env = {key: value for key, value in env.items() if key != "TRITON_INTERPRET"}
        compiled = subprocess.run([sys.executable, "-m", triton_launches.__name__, str(log)],
                                  env=env, capture_output=True, text=True, timeout=900)
        assert compiled.returncode == 0, compiled.stdout[-6000:] + compiled.stderr[-3000:]


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

