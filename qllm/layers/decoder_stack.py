"""The decoder stack shared by the Qwen models: embedding, decoder layers, final norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from qllm.batch import ForwardBatch


class DecoderStack(nn.Module):
    """``embed_tokens`` -> ``layers`` -> ``norm``, with HF's parameter names.

    Each layer maps ``(positions, hidden, residual, batch)`` to ``(hidden, residual)``, the
    residual being None before the first layer (its input norm then adds nothing). Prefill
    calls each layer's plain ``forward``, bypassing a layer compiled for decode (see
    ``CausalLM.prefill_regions``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers: Iterable[nn.Module],
                 norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (or ``[A, T]``) -> final hidden states
        ``[T, H]``."""
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        if batch.encoder_rows is not None:  # media placeholders take their encoders' output
            hidden = hidden.index_copy(0, batch.encoder_rows,
                                       batch.encoder_embeds.to(hidden.dtype))
        for layer in self.layers:
            run = layer.forward if batch.is_prefill else layer
            hidden, residual = run(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden
