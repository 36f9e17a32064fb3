"""Steps through CUDA graphs, captured at start-up: decode, one graph per padded batch-size
bucket; the prefill of one sequence's last prompt tokens, one graph per padded token-count
bucket (a short prompt's prefill is hundreds of small kernels, so launching them one by one
takes longer than running them).

Each captured step reads its inputs from static buffers (views of one staged buffer per
bucket, ``qllm.runner.staging``) and writes logits to a static output, so a replay is: copy
the step's staged inputs in (one device copy), replay, read the logits. Cache storage has
fixed addresses, so the graph writes K/V and recurrent state in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import torch
from tqdm.auto import tqdm

from qllm.batch import ForwardBatch


class HostSyncError(RuntimeError):
    """A step to capture waits on the device from the host (reads a device value), which a
    CUDA graph cannot hold."""


class CudaGraphCapture:
    """Captures a callable as a CUDA graph (after a warm-up run outside the graph, then a
    run that fails on any host sync, ``HostSyncError``, before a capture could begin); all
    graphs share one memory pool. Returns ``(graph, output)``; ``graph.replay()`` reruns
    it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn):
        fn()  # warm-up outside the graph (compiles and tunes this shape if needed)
        torch.cuda.synchronize(self.device)
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as exc:
            if "synchronizing" not in str(exc):
                raise
            raise HostSyncError(str(exc)) from exc
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph, output


@dataclasses.dataclass(frozen=True)
class GraphShape:
    """The fixed shape of a captured step, which a smaller step is padded up to with inert
    rows (each of ``padding_len`` tokens at positions ``0 ..``, naming only the cache kinds'
    padding units; ``CachePool.step_fields``).

    Decode: ``size`` sequences of one token each; a batch of fewer sequences gets one-token
    inert rows. Prefill: one sequence's last ``n <= size`` prompt tokens, then one inert row
    of the other ``size - n`` (possibly none); at capture, with no sequence, two inert rows
    of ``size // 2``. Every row samples its last token, so the layout never changes.
    """

    is_prefill: bool
    size: int  # decode: sequences; prefill: tokens

    def padding(self, num_seqs: int, num_tokens: int) -> tuple[int, int]:
        """``(inert rows, tokens in each)`` that pad a step of ``num_seqs`` sequences and
        ``num_tokens`` tokens to this shape."""
        if not self.is_prefill:
            return self.size - num_seqs, 1
        if num_seqs == 0:
            return 2, self.size // 2
        return 1, self.size - num_tokens


class StepGraphs:
    """Graphs of ``step(input_ids, positions, batch) -> logits`` for each bucket size of one
    phase (decode: sequences; prefill: tokens).

    ``make_inputs(size)`` returns inert padded inputs of a bucket, staged in one buffer
    (``batch.staged``; used for capture, they are the graph's static inputs); ``capture(fn) ->
    (graph, output)`` records one graph (``CudaGraphCapture`` on a GPU).
    """

    def __init__(self, step, make_inputs, sizes: list[int], capture, phase: str = "decode"):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, object] = {}
        self.inputs: dict[int, tuple] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        for size in tqdm(sorted(self.sizes, reverse=True), desc=f"Capturing {phase} graphs",
                         unit="graph"):
            self.inputs[size] = make_inputs(size)
            self.graphs[size], self.outputs[size] = capture(
                functools.partial(step, *self.inputs[size]))

    def bucket(self, count: int) -> int | None:
        """The smallest captured size holding ``count`` (sequences or tokens), or None when
        none does."""
        index = bisect.bisect_left(self.sizes, count)
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
