"""Presence, frequency and repetition penalties and ``min_tokens``, applied to a step's logits
on the device, as vLLM defines them:

- ``presence_penalty`` is subtracted from the logit of every token generated so far, once;
  ``frequency_penalty`` once per time it was generated;
- ``repetition_penalty`` divides the positive logits and multiplies the negative ones of the
  tokens in the prompt or generated so far;
- while fewer than ``min_tokens`` tokens are generated, EOS (unless ``ignore_eos``) and
  ``stop_token_ids`` get a logit of -inf.

Built only for a step where some row uses them (``LogitsAdjustments.build`` returns None
otherwise), so other steps pay nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from qllm.config import SamplingParams


@dataclass
class LogitsAdjustments:
    """One step's penalties and bans as device tensors, one row per sampled sequence."""

    presence: torch.Tensor | None      # [N] fp32, None when no row has presence/frequency
    frequency: torch.Tensor | None     # [N] fp32
    output_counts: torch.Tensor | None  # [N, V] fp32, times each token was generated
    repetition: torch.Tensor | None    # [N] fp32, None when no row has repetition_penalty
    seen: torch.Tensor | None          # [N, V] bool, in the prompt or generated
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows [B], token ids [B]) set to -inf

    @classmethod
    def build(cls, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]], pending: tuple[list[int], torch.Tensor] | None,
              num_outputs: list[int], eos_token_ids: set[int], vocab_size: int,
              device: torch.device) -> "LogitsAdjustments | None":
        """``prompts[i]`` / ``outputs[i]``: row i's prompt and generated tokens known on the
        host; ``pending``: (rows, their generated tokens still on the device ``[P]``), one
        each at most; ``num_outputs[i]``: row i's generated tokens, pending included."""
        use_counts = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
        use_repetition = any(p.repetition_penalty != 1 for p in params)
        banned_rows, banned_ids = [], []
        for row, (p, count) in enumerate(zip(params, num_outputs)):
            if count < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
                ids = sorted(t for t in ids if t < vocab_size)
                banned_rows += [row] * len(ids)
                banned_ids += ids
        if not (use_counts or use_repetition or banned_rows):
            return None
        # (row, token) pairs: the generated tokens of rows that need them, the prompt tokens
        # of rows with a repetition penalty
        pin = device.type == "cuda"
        out_pairs = _pairs([out if p.uses_penalties else [] for p, out in zip(params, outputs)],
                           device)
        floats = torch.tensor([[p.presence_penalty for p in params],
                               [p.frequency_penalty for p in params],
                               [p.repetition_penalty for p in params]],
                              dtype=torch.float32, pin_memory=pin).to(device, non_blocking=True)
        counts = None
        if use_counts or use_repetition:
            counts = torch.zeros((len(params), vocab_size), dtype=torch.float32, device=device)
            one = torch.ones(1, device=device)
            if out_pairs is not None:
                counts.index_put_(out_pairs, one, accumulate=True)
            if pending is not None and pending[0]:
                rows = torch.tensor(pending[0], dtype=torch.int64, pin_memory=pin).to(
                    device, non_blocking=True)
                counts.index_put_((rows, pending[1]), one, accumulate=True)
        seen = None
        if use_repetition:
            seen = counts > 0
            prompt_pairs = _pairs([prompt if p.repetition_penalty != 1 else []
                                   for p, prompt in zip(params, prompts)], device)
            if prompt_pairs is not None:
                seen[prompt_pairs] = True
        banned = None
        if banned_rows:
            pairs = torch.tensor([banned_rows, banned_ids], dtype=torch.int64,
                                 pin_memory=pin).to(device, non_blocking=True)
            banned = (pairs[0], pairs[1])
        return cls(presence=floats[0] if use_counts else None,
                   frequency=floats[1] if use_counts else None,
                   output_counts=counts if use_counts else None,
                   repetition=floats[2] if use_repetition else None,
                   seen=seen, banned=banned)


def _pairs(rows: list[list[int]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(row index [M], token [M])`` on ``device`` of every token of ``rows``, or None if
    there are none. The tokens cross as one flat array (``np.fromiter``: a nested list
    through ``torch.tensor`` took ~10x longer at W1's 256 x ~1,000 tokens); the row index is
    expanded on the device, its size known, so without a sync."""
    lengths = [len(tokens) for tokens in rows]
    total = sum(lengths)
    if not total:
        return None
    pin = device.type == "cuda"
    host = torch.from_numpy(np.fromiter(itertools.chain(lengths, *rows), dtype=np.int64,
                                        count=len(rows) + total))
    staged = (host.pin_memory() if pin else host).to(device, non_blocking=True)
    index = torch.repeat_interleave(torch.arange(len(rows), device=device),
                                    staged[:len(rows)], output_size=total)
    return index, staged[len(rows):]


def apply_penalties(logits: torch.Tensor, adjust: LogitsAdjustments) -> torch.Tensor:
    """``logits [N, V]`` with the step's penalties and bans applied -> a new fp32 tensor
    (the input, possibly a CUDA graph's static output, is left as it was)."""
    logits = logits.to(torch.float32, copy=True)
    if adjust.seen is not None:
        repetition = adjust.repetition[:, None]
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(adjust.seen, penalized, logits)
    if adjust.output_counts is not None:
        counts = adjust.output_counts
        logits -= adjust.frequency[:, None] * counts + adjust.presence[:, None] * (counts > 0)
    if adjust.banned is not None:
        logits[adjust.banned] = float("-inf")
    return logits
