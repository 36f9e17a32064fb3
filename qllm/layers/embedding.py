"""The LM head."""

from __future__ import annotations

import torch
from torch import nn

from qllm.plugins.registry import Kernels


class LMHead(nn.Module):
    """Projects final hidden states ``[N, H]`` to logits ``[N, V]`` in the model's dtype (the
    sampler upcasts where it computes probabilities; a greedy argmax needs no fp32 copy, which
    at decode batch 200 and Qwen3.5's 248k vocabulary is 200 MB written per step).

    The matmul is the model's ``linear`` op, as for every projection: at decode batch 1 the
    linear plugin's GEMV serves Qwen3.5's 1 GB head (on cuBLAS it took 331 us of W3's H100
    step; the GEMV's own time there is not yet measured). With tied embeddings the model
    points ``weight`` at the embedding's (``tie_weights``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, kernels: Kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self._linear = kernels.linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.weight, None)
