"""Log-probabilities of sampled and prompt tokens: computed on the device, packed into one
int64 tensor with the tokens they belong to, so that the step's one device-to-host copy
brings both; unpacked on the host into ``{token_id: Logprob}`` dicts.

They are of the raw model distribution, ``log_softmax`` of the logits before penalties,
temperature and top-k/top-p (vLLM's default, "raw_logprobs").

Packed layout, one row per token, ``K`` the step's widest request:
``[token, rank, top_ids (K), token_logprob, top_logprobs (K)]``, the ``K + 1`` log-probs
stored as float64 bit patterns (``Tensor.view(torch.int64)``), which hold fp32 exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# rows of prompt logits materialised at once: [rows, V] fp32 twice (logits and log-probs),
# about 310 MB at a 152k vocabulary
PROMPT_CHUNK_ROWS = 256


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the model and its rank (1: the most likely)."""

    logprob: float
    rank: int


def packed_width(k: int) -> int:
    return 3 + 2 * k


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [M, V]`` (raw, any float dtype) and the tokens they scored ``[M]`` ->
    packed ``[M, 3 + 2k]`` int64 (see the module docstring): each token's log-prob and rank
    and the ``k <= V`` most likely tokens with theirs (the engine refuses more: the packed
    width must be the ``k`` that ``unpack`` reads). No host sync."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                   # [M, V]
    chosen = logprobs.gather(-1, tokens[:, None])                           # [M, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1                # [M, 1]
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)                        # [M, k]
    floats = torch.cat([chosen, top_logprobs], dim=-1).double().view(torch.int64)
    return torch.cat([tokens[:, None], rank, top_ids, floats], dim=-1)


def tokens_only(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``tokens [N]`` in the packed layout of width ``k`` with no log-probs (zeros)."""
    packed = tokens.new_zeros((tokens.shape[0], packed_width(k)))
    packed[:, 0] = tokens
    return packed


def prompt_token_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                          hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                          k: int) -> torch.Tensor:
    """Packed log-probs of prompt tokens: row ``rows[i]`` of ``hidden [T, H]`` predicts
    ``targets[i]``. Logits are computed ``PROMPT_CHUNK_ROWS`` rows at a time."""
    parts = [token_logprobs(compute_logits(hidden[rows[i:i + PROMPT_CHUNK_ROWS]]),
                            targets[i:i + PROMPT_CHUNK_ROWS], k)
             for i in range(0, rows.shape[0], PROMPT_CHUNK_ROWS)]
    return torch.cat(parts) if parts else targets.new_zeros((0, packed_width(k)))


def unpack(host: torch.Tensor, k: int, wanted: list[int | None]) -> list[dict | None]:
    """Host rows of packed width ``k`` -> per row ``{token: Logprob}``: the scored token
    first, then the ``wanted[i]`` most likely tokens not already in (so ``wanted[i]`` or
    ``wanted[i] + 1`` entries); None where ``wanted[i]`` is None."""
    if not any(w is not None for w in wanted):
        return [None] * len(wanted)
    ints = host[:, :2 + k].tolist()
    floats = host[:, 2 + k:].view(torch.float64).tolist()
    out: list[dict | None] = []
    for w, row, lps in zip(wanted, ints, floats):
        if w is None:
            out.append(None)
            continue
        entry = {row[0]: Logprob(lps[0], row[1])}
        for j in range(min(w, k)):
            entry.setdefault(row[2 + j], Logprob(lps[1 + j], j + 1))
        out.append(entry)
    return out
