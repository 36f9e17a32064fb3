"""The kernel micro-benchmarks' timing (``triton.testing.do_bench``, eager or as a CUDA-graph
replay), their sweeps' compiles ahead of timing, and report: a fixed-width table for reading,
then one JSON line per row for tools."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable

import torch

from qllm.runner.triton_precompile import compile_launches

# (row key, column title, width, number format); a format of None is a left-aligned text column
Column = tuple[str, str, int, str | None]


def graphed(call):
    """``call`` captured in a CUDA graph (already warmed up); returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def time_ms(call, graph: bool, rep: int = 100) -> float:
    """Median ms of ``call`` (run once first, to compile) over ``rep`` ms of runs of
    ``triton.testing.do_bench`` (the L2 cache flushed before each), as a CUDA-graph replay or
    eagerly."""
    from triton.testing import do_bench

    call()
    return do_bench(graphed(call) if graph else call, rep=rep, return_mode="median")


def compile_ahead(calls: Iterable[Callable[[], object]], workers: int | None = None) -> None:
    """Compile the Triton kernels that ``calls`` would launch, in ``workers`` threads (default:
    the CPU count), launching nothing; returns once all are compiled (a sweep's candidates:
    Triton's compiler runs outside the GIL, so 100 configs on 16 cores take about 7 configs'
    time). Each call runs with every Triton launch turned into a compile
    (``qllm.runner.triton_precompile.compile_launches``: an autotuned kernel compiles all its
    configs and tunes none), so its other work runs on unwritten outputs: only for calls
    whose launches do not depend on values computed by earlier launches. A call that raises,
    or a config that fails to compile, is left to fail again when timed."""
    with compile_launches(workers):
        for call in calls:
            with contextlib.suppress(Exception):
                call()


def print_table(rows: list[dict], columns: list[Column]) -> None:
    """Print ``rows`` as a table of ``columns``, one space apart (a missing or None value
    leaves its cell blank), then each row as JSON."""

    def cell(text: str, width: int, number_format: str | None) -> str:
        return f"{text:<{width}}" if number_format is None else f"{text:>{width}}"

    header = " ".join(cell(title, width, fmt) for _, title, width, fmt in columns)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = []
        for key, _, width, fmt in columns:
            value = row.get(key)
            text = "" if value is None else str(value) if fmt is None else format(value, fmt)
            cells.append(cell(text, width, fmt))
        print(" ".join(cells).rstrip())
    for row in rows:
        print(json.dumps(row))
