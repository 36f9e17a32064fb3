"""``ForwardBatch``: everything one model step needs to know about its batch, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qllm.runner.staging import Layout


@dataclass
class ForwardBatch:
    """Metadata of one step over ``B`` sequences and ``T`` new tokens.

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flattened ``[T, ...]`` activations and sit at absolute positions
    ``context_lens[i] .. seq_lens[i] - 1``. In a decode step ``T == B`` (one token each), and
    the batch may be padded up to a CUDA-graph size: a padded row holds one token at position
    0 (``seq_lens == 1``, ``context_lens == 0``) and names only each cache kind's padding
    unit (the padding block, the padding slot), which no sequence holds.

    ``caches`` holds each cache kind's own fields of the step, built by its pool
    (``CachePool.step_fields``) into the pool's ``batch_type``: a layer reads its kind's,
    e.g. ``batch.caches["paged_kv"].block_tables`` (``qllm.cache.paged_kv.PagedKVBatch``) or
    ``batch.caches["recurrent_slot"].slots`` (``qllm.cache.recurrent_slots
    .RecurrentSlotBatch``). A kind the model has no layer of has no entry.

    Host-side copies (``*_host``, ``max_*``) exist only for prefill, which runs eagerly;
    decode kernels must use the tensors alone so the step can be captured in a graph.
    """

    is_prefill: bool
    query_start_loc: torch.Tensor      # [B + 1] int32
    seq_lens: torch.Tensor             # [B] int32, tokens in the cache after this step
    context_lens: torch.Tensor         # [B] int32, tokens in the cache before this step
    logits_indices: torch.Tensor       # [N] int64, rows whose next token is sampled
    caches: dict[str, Any]             # cache kind -> its fields of this step (tensors)
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    max_query_len: int = 1
    max_seq_len: int = 0
    # the one device buffer that the tensors above (and the step's token ids and positions)
    # view, copied in once (``qllm.runner.staging``), and where each field lies in it; None
    # for a batch built another way
    staged: torch.Tensor | None = None
    staged_layout: Layout | None = None
    # prefill rows of media placeholders and what replaces their token embeddings (their
    # encoders' outputs, ``qllm.multimodal``); None in a step without media
    encoder_rows: torch.Tensor | None = None    # [M] int64
    encoder_embeds: torch.Tensor | None = None  # [M, H]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
