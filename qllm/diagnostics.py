"""Engine diagnostics: next-token logits under teacher forcing, so that two engines (compiled
and eager, fp32 and bf16 state, ...) compare on identical inputs at every step. Used by the
GPU tests and the accuracy benchmarks."""

from __future__ import annotations

import torch

from qllm.config import SamplingParams
from qllm.engine.scheduler import ScheduledBatch
from qllm.engine.sequence import Sequence


@torch.inference_mode()
def teacher_forced_logits(llm, prompts: list[list[int]],
                          continuations: list[list[int]]) -> torch.Tensor:
    """Next-token logits ``[steps, B, V]`` (fp32, on the host) that predict each token of
    ``continuations`` (``steps`` tokens for every prompt): one prefill of all ``prompts``,
    then one decode step per token, fed ``continuations[b][step]``. Decode goes through the
    engine's runner, so through its CUDA graphs where it has them, and stores (and rounds)
    the recurrent state after every token. The prefix cache is emptied first, so every
    prompt is computed in full; the cache is free again afterwards."""
    engine, runner = llm.engine, llm.engine.runner
    engine.cache.reset_prefix_cache()
    seqs = [Sequence(prompt, SamplingParams(temperature=0)) for prompt in prompts]
    for seq in seqs:
        if not (engine.cache.admit(seq) and engine.cache.reserve(seq, len(seq))):
            raise RuntimeError("the cache cannot hold every prompt at once")
    try:
        steps = [runner.step_logits(
            ScheduledBatch(seqs, [len(seq) for seq in seqs], is_prefill=True)).float().cpu()]
        for step in range(len(continuations[0]) - 1):
            for seq, tokens in zip(seqs, continuations):
                seq.num_computed_tokens = len(seq)
                seq.append_token(tokens[step])
                if not engine.cache.reserve(seq, 1):
                    raise RuntimeError("the cache ran out of blocks")
            steps.append(runner.step_logits(
                ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False)).float().cpu())
        return torch.stack(steps)
    finally:
        for seq in seqs:
            engine.cache.release(seq)
