"""The LM head."""

from __future__ import annotations

import torch
from torch import nn


class LMHead(nn.Module):
    """Projects final hidden states ``[N, H]`` to fp32 logits ``[N, V]``.

    With tied embeddings the model points ``weight`` at the embedding's (``tie_weights``).
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight).float()
