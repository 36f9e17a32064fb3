"""The ``sample_tokens`` op's plain-torch reference: one token per row of logits, drawn at each
row's temperature (``qllm.layers.sampler`` calls it once its filters have run)."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """The ``sample_tokens`` op: ``logits [N, V]`` (any float dtype), ``temperature [N]`` fp32
    (``>= 0``) and an integer ``seed`` -> ``[N]`` int64: per row, a token drawn from
    ``softmax(logits / temperature)`` computed in fp32, or, where the temperature is 0,
    ``argmax(logits)`` (the first of equal maxima). Logits of ``-inf`` (a top-k / top-p
    filter's) are never drawn.

    The draw is the exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn per element
    (in logits, the Gumbel-max trick ``argmax(logits / T - log q)``). ``seed`` fixes the noise
    of one implementation: kernels draw from the same distribution, not the same noise, so
    the same seed need not give another kernel's tokens. No host sync."""
    scaled = scale(logits, temperature)
    noise = torch.empty_like(scaled).exponential_(
        generator=torch.Generator(logits.device).manual_seed(seed))
    return torch.where(temperature > 0, exponential_race(scaled, noise), logits.argmax(dim=-1))


def scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` in fp32 divided by each row's ``temperature [N]`` (rows at 0 by 1)."""
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]


def exponential_race(scaled: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(softmax(scaled) / noise)`` per row: with ``noise [N, V] ~ Exp(1)``, a draw from
    ``softmax(scaled [N, V])`` -> ``[N]`` int64."""
    return (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
