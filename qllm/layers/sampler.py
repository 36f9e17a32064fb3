"""Token sampling on the device: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.config import SamplingParams


@dataclass
class SamplingTensors:
    """One step's sampling settings as device tensors, one row per sampled sequence."""

    # None when every row is greedy (an argmax needs no settings on the device)
    temperature: torch.Tensor | None  # [N] fp32, 0 for greedy rows
    top_k: torch.Tensor | None        # [N] int64, vocab size where disabled or larger
    top_p: torch.Tensor | None        # [N] fp32
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device) -> "SamplingTensors":
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(
                device, non_blocking=True)

        if all(p.greedy for p in params):
            return cls(None, None, None, generators, all_greedy=True, any_top_k=False,
                       any_top_p=False)
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        return cls(temperature=tensor([p.temperature for p in params], torch.float32),
                   top_k=tensor(top_k, torch.int64),
                   top_p=tensor([p.top_p for p in params], torch.float32),
                   generators=generators,
                   all_greedy=False,
                   any_top_k=any(k < vocab_size for k in top_k),
                   any_top_p=any(p.top_p < 1 for p in params))


def sample(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """Pick one token per row of ``logits [N, V]`` (any float dtype; probabilities in fp32)
    -> ``[N]`` int64, without a host sync.

    Sampling uses the exponential race ``argmax(p / q), q ~ Exp(1)``, which draws from ``p``;
    rows with a seed draw ``q`` from their own generator, so their tokens do not depend on
    what else is in the batch.
    """
    greedy = logits.argmax(dim=-1)
    if settings.all_greedy:
        return greedy
    temperature = torch.where(settings.temperature > 0, settings.temperature, 1.0)
    logits = logits.float() / temperature[:, None]
    if settings.any_top_k or settings.any_top_p:
        logits = _filter_top_k_top_p(logits, settings)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(settings.generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(settings.temperature > 0, sampled, greedy)


def _filter_top_k_top_p(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= settings.top_k[:, None], float("-inf"))
    if settings.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        sorted_logits = sorted_logits.masked_fill(mass_before >= settings.top_p[:, None],
                                                  float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
