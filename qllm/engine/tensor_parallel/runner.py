"""The model runners of a tensor-parallel engine: rank 0's ``DriverRunner`` (the engine's
runner) and every other rank's ``WorkerRunner``.

A step: the driver builds its inputs on the host (``ModelRunner.host_inputs``), sends them to
the workers once (one small picklable ``StepMessage`` over the control group), and every rank
stages them and runs its shard of the model, the layers' all-reduces keeping the ranks in
step. Only the driver computes logits and samples; its sampled tokens go to the workers by
one device broadcast, since the next step's pending input tokens (async scheduling) come
from them. Block tables and slot ids are the driver's bookkeeping, the same for every rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from qllm.runner.cuda_graphs import GraphShape
from qllm.runner.model_runner import HostInputs, ModelRunner, SampledStep


@dataclasses.dataclass
class StepMessage:
    """One step for the workers: its inputs, the shape of the captured graph to replay (None:
    run the layers as they are), whether the driver broadcasts the step's sampled tokens after it,
    and the cache copies (``(kind, sources, targets)``, recurrent-state checkpoints) that
    the driver's pools made since the last step, to repeat first."""

    inputs: HostInputs
    graph: GraphShape | None
    send_tokens: bool
    copies: list[tuple[str, list[int], list[int]]]


class CheckedSampledStep(SampledStep):
    """A driver step's tokens, checked against the workers' health once waited for (a step
    whose collectives a dead rank left unfinished gives no tokens to trust)."""

    executor = None

    def tokens(self) -> list[int]:
        tokens = super().tokens()
        self.executor.check()
        return tokens


class DriverRunner(ModelRunner):
    """Rank 0's runner: ``ModelRunner`` that also drives the workers (``executor``)."""

    def __init__(self, *args, executor, **kwargs):
        self.executor = executor
        self._launching = False
        self._copies: list[tuple[str, list[int], list[int]]] = []
        super().__init__(*args, **kwargs)
        for name, pool in self.pools:  # repeat the pools' own device copies on the workers
            copy = getattr(pool, "_copy", None)
            if copy is not None:
                pool._copy = self._recording(name, copy)

    def _recording(self, name, copy):
        def recorded(sources: list[int], targets: list[int]) -> None:
            copy(sources, targets)
            self._copies.append((name, list(sources), list(targets)))
        return recorded

    def _step_inputs(self, scheduled, previous, graph=None):
        inputs = self.host_inputs(scheduled, graph, fixed_layout=graph is not None,
                                  previous=previous)
        embeds = inputs.encoder_embeds
        message = StepMessage(
            dataclasses.replace(inputs, encoder_embeds=None if embeds is None else embeds.cpu()),
            graph, self._launching and inputs.num_sampled > 0, self._copies)
        self._copies = []
        self.executor.send(("step", message))
        return self.stage_inputs(inputs, None if previous is None else previous.device_tokens)

    @torch.inference_mode()
    def launch(self, scheduled, previous=None, eos_token_ids=frozenset()) -> SampledStep:
        self.executor.check()
        self._launching = True
        try:
            step = super().launch(scheduled, previous, eos_token_ids)
            if step.seqs:
                self.executor.broadcast_tokens(step.device_tokens)
        except Exception as exc:  # a collective that a dead rank left: say which rank
            self.executor.fail(exc)
        finally:
            self._launching = False
        checked = CheckedSampledStep(step.batch, step.seqs, step.device_tokens,
                                     step.host_tokens, step.copied, step.num_logprobs,
                                     step.prompt_spans)
        checked.executor = self.executor
        return checked


class WorkerRunner(ModelRunner):
    """A worker rank's runner: runs the driver's steps on its shard of the model; samples
    nothing (its logits, where a graph computes them, go unused)."""

    def __init__(self, *args, device_group=None, **kwargs):
        self.device_group = device_group
        self.last_tokens: torch.Tensor | None = None  # the driver's latest sampled tokens
        super().__init__(*args, **kwargs)

    @torch.inference_mode()
    def run(self, message: StepMessage) -> None:
        for name, sources, targets in message.copies:
            self.cache.pools[name]._copy(sources, targets)
        input_ids, positions, batch = self.stage_inputs(message.inputs, self.last_tokens)
        if message.graph is not None:
            self.replay(message.graph, input_ids, positions, batch)
        else:
            self.model(input_ids, positions, batch)
        if message.send_tokens:
            tokens = torch.empty(message.inputs.num_sampled, dtype=torch.int64,
                                 device=self.device)
            dist.broadcast(tokens, src=0, group=self.device_group)
            self.last_tokens = tokens
