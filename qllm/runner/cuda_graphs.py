"""Decode through CUDA graphs: one graph per padded batch-size bucket, captured at start-up.

Each captured step reads its inputs from static buffers (views of one staged buffer per
bucket, ``qllm.runner.staging``) and writes logits to a static output, so a replay is: copy
the step's staged inputs in (one device copy), replay, read the logits. Cache storage has
fixed addresses, so the graph writes K/V and recurrent state in place.
"""

from __future__ import annotations

import bisect
import functools

import torch
from tqdm.auto import tqdm

from qllm.batch import ForwardBatch


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

    ``make_inputs(size)`` returns inert padded inputs of a bucket, staged in one buffer
    (``batch.staged``; used for capture, they are the graph's static inputs); ``capture(fn) ->
    (graph, output)`` records one graph (``CudaGraphCapture`` on a GPU).
    """

    def __init__(self, step, make_inputs, sizes: list[int], capture):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, object] = {}
        self.inputs: dict[int, tuple] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing decode graphs",
                         unit="graph"):
            self.inputs[size] = make_inputs(size)
            self.graphs[size], self.outputs[size] = capture(
                functools.partial(step, *self.inputs[size]))

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size holding ``batch_size``, or None when none does."""
        index = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        """Run the graph of the bucket ``len(input_ids)``. The inputs must be padded to it and
        staged like the graph's own (``ModelRunner.prepare`` with ``fixed_layout``: the same
        fields, dtypes and shapes), so one copy of the staged buffer's head refreshes every
        static input."""
        size = input_ids.shape[0]
        _, _, static_batch = self.inputs[size]
        layout = batch.staged_layout or {}
        for name, entry in static_batch.staged_layout.items():  # (offset, bytes, dtype, shape)
            if layout.get(name) != entry:
                raise ValueError(
                    f"staged input {name!r} is laid out unlike the graph's: {layout.get(name)} "
                    f"against {entry} (prepare the step with the graph's fixed layout)")
        static = static_batch.staged
        static.copy_(batch.staged[:static.shape[0]])
        self.graphs[size].replay()
        return self.outputs[size]
