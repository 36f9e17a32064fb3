"""Timing helpers shared by the kernel micro-benchmarks."""

from __future__ import annotations

import torch
from triton.testing import do_bench


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
    call()
    return do_bench(graphed(call) if graph else call, rep=rep, return_mode="median")
