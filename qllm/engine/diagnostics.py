"""Engine diagnostics: next-token logits under teacher forcing, so that two engines (compiled
and eager, fp32 and bf16 state, ...) compare on identical inputs at every step. Used by the
GPU tests and the accuracy benchmarks."""

from __future__ import annotations

import torch

from qllm.batch import Sequence
from qllm.config import SamplingParams


@torch.inference_mode()
def teacher_forced_logits(llm, prompts: list[list[int]],
                          continuations: list[list[int]]) -> torch.Tensor:
    """Next-token logits ``[steps, B, V]`` (fp32, on the host) that predict each token of
    ``continuations`` (``steps`` tokens for every prompt): one prefill of all ``prompts``,
    then one decode step per token, fed ``continuations[b][step]``. The engine's scheduler
    runs each step as it would a request's, the forced tokens in place of sampled ones;
    decode goes through the engine's runner, so through its CUDA graphs where it has them,
    and stores (and rounds) the recurrent state after every token. The prefix cache is off
    meanwhile and emptied, so every prompt is computed in full; the cache is free again
    afterwards. The engine must be idle, with room for every prompt in one step."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    if engine.has_unfinished():
        raise RuntimeError("the engine is serving requests; teacher forcing needs it idle")
    num_steps = len(continuations[0])
    params = SamplingParams(temperature=0, max_tokens=num_steps, ignore_eos=True)
    seqs = [Sequence(prompt, params) for prompt in prompts]
    steps = []
    with engine.cache.prefix_caching_paused():
        for seq in seqs:
            scheduler.add(seq)
        try:
            for step in range(num_steps):
                batch = scheduler.schedule()
                if batch is None or batch.seqs != seqs or any(
                        n != seq.num_uncomputed_tokens for seq, n in zip(seqs, batch.num_tokens)):
                    raise RuntimeError("the engine cannot run every prompt in one step "
                                       "(max_num_seqs, max_num_batched_tokens or the cache "
                                       "is too small)")
                steps.append(engine.runner.step_logits(batch).float().cpu())
                scheduler.launched(batch, seqs)
                scheduler.postprocess(batch, seqs, [tokens[step] for tokens in continuations],
                                      engine.eos_token_ids)
        finally:
            for seq in seqs:
                if not seq.is_finished:
                    scheduler.finish(seq, "abort")
    return torch.stack(steps)
