"""Decode through CUDA graphs: one graph per padded batch-size bucket, captured at start-up.

Each captured step reads its inputs from static buffers (the largest bucket's, sliced per
bucket) and writes logits to a static output, so a replay is: copy the step's inputs in,
replay, read the logits. Cache storage has fixed addresses, so the graph writes K/V and
recurrent state in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import torch
from tqdm.auto import tqdm

from qllm.runner.batch import ForwardBatch

TENSOR_FIELDS = [f.name for f in dataclasses.fields(ForwardBatch)
                 if f.type in ("torch.Tensor", torch.Tensor)]


class CudaGraphCapture:
    """Captures a callable as a CUDA graph (after one warm-up run outside the graph); all
    graphs share one memory pool. Returns ``(graph, output)``; ``graph.replay()`` reruns it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn):
        fn()  # warm-up outside the graph (compiles this shape if needed)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph, output


class DecodeGraphs:
    """Graphs of ``step(input_ids, positions, batch) -> logits`` for each bucket size.

    ``make_inputs(size)`` returns inert padded inputs of a bucket (used for capture);
    ``capture(fn) -> (graph, output)`` records one graph (``CudaGraphCapture`` on a GPU).
    """

    def __init__(self, step, make_inputs, sizes: list[int], capture):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, object] = {}
        self.inputs: dict[int, tuple] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        largest = make_inputs(self.sizes[-1])
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing decode graphs",
                         unit="graph"):
            inputs = self._slice(largest, size)
            self.graphs[size], self.outputs[size] = capture(functools.partial(step, *inputs))
            self.inputs[size] = inputs

    @staticmethod
    def _slice(inputs: tuple, size: int) -> tuple:
        input_ids, positions, batch = inputs
        fields = {name: getattr(batch, name)[:size + 1 if name == "query_start_loc" else size]
                  for name in TENSOR_FIELDS}
        return input_ids[:size], positions[:size], dataclasses.replace(batch, **fields)

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size holding ``batch_size``, or None when none does."""
        index = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        """Run the graph of the bucket ``len(input_ids)`` (inputs already padded to it)."""
        size = input_ids.shape[0]
        static_ids, static_positions, static_batch = self.inputs[size]
        static_ids.copy_(input_ids)
        static_positions.copy_(positions)
        for name in TENSOR_FIELDS:
            source = getattr(batch, name)
            getattr(static_batch, name)[:source.shape[0]].copy_(source)
        self.graphs[size].replay()
        return self.outputs[size]
