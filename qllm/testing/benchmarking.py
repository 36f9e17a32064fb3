"""The kernel micro-benchmarks' timing (``triton.testing.do_bench``, eager or as a CUDA-graph
replay) and report: a fixed-width table for reading, then one JSON line per row for tools."""

from __future__ import annotations

import json

import torch

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
