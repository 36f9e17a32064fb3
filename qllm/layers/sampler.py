"""Token sampling on the device: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.config import SamplingParams
from qllm.ops.sampling import exponential_race, scale
from qllm.ops.sampling import sample_tokens as reference_sample_tokens

SEED_BOUND = 2 ** 62  # the seeds drawn for the ``sample_tokens`` op lie in [0, SEED_BOUND)


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


def sample(logits: torch.Tensor, settings: SamplingTensors,
           sample_tokens=reference_sample_tokens) -> torch.Tensor:
    """Pick one token per row of ``logits [N, V]`` (any float dtype; probabilities in fp32)
    -> ``[N]`` int64, without a host sync.

    Draws follow the exponential race ``argmax(p / q), q ~ Exp(1)``, which draws from ``p``.
    Rows with a seed draw ``q`` from their own generator, so their tokens do not depend on
    what else is in the batch: a batch holding one is drawn here, in plain torch. Any other
    batch goes to ``sample_tokens`` (the ``sample_tokens`` op, ``qllm.ops.sampling``; the
    engine passes its kernel) with a seed from torch's default CPU generator, so
    ``torch.manual_seed`` makes a run repeatable; after the top-k / top-p filter where a row
    asks for one.
    """
    if settings.all_greedy:
        return logits.argmax(dim=-1)
    if any(generator is not None for generator in settings.generators):
        return _sample_with_generators(logits, settings)
    seed = int(torch.randint(SEED_BOUND, ()))
    if not (settings.any_top_k or settings.any_top_p):
        return sample_tokens(logits, settings.temperature, seed)
    sampled = settings.temperature > 0
    filtered = _filter_top_k_top_p(scale(logits, settings.temperature), settings)
    drawn = sample_tokens(filtered, sampled.float(), seed)  # already scaled: temperature 1
    return torch.where(sampled, drawn, logits.argmax(dim=-1))


def _sample_with_generators(logits: torch.Tensor, settings: SamplingTensors) -> torch.Tensor:
    """``sample`` of a batch where some rows draw from their own generator."""
    scaled = scale(logits, settings.temperature)
    if settings.any_top_k or settings.any_top_p:
        scaled = _filter_top_k_top_p(scaled, settings)
    noise = torch.empty_like(scaled).exponential_()
    for row, generator in enumerate(settings.generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return torch.where(settings.temperature > 0, exponential_race(scaled, noise),
                       logits.argmax(dim=-1))


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
