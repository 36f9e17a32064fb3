"""The LM head."""

from __future__ import annotations

import torch
from torch import nn


class LMHead(nn.Module):
    """Projects final hidden states ``[N, H]`` to logits ``[N, V]`` in the model's dtype (the
    sampler upcasts where it computes probabilities; a greedy argmax needs no fp32 copy, which
    at decode batch 200 and Qwen3.5's 248k vocabulary is 200 MB written per step).

    With tied embeddings the model points ``weight`` at the embedding's (``tie_weights``).
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)
