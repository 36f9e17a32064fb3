"""``ForwardBatch``: everything one model step needs to know about its batch, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Metadata of one step over ``B`` sequences and ``T`` new tokens.

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flattened ``[T, ...]`` activations and sit at absolute positions
    ``context_lens[i] .. seq_lens[i] - 1``. In a decode step ``T == B`` (one token each), and
    the batch may be padded up to a CUDA-graph size: padded rows have ``seq_lens == 1``, write
    their K/V to the padding block and use the padding recurrent slot.

    Host-side copies (``*_host``, ``max_*``) exist only for prefill, which runs eagerly;
    decode kernels must use the tensors alone so the step can be captured in a graph.
    """

    is_prefill: bool
    query_start_loc: torch.Tensor      # [B + 1] int32
    seq_lens: torch.Tensor             # [B] int32, tokens in the cache after this step
    context_lens: torch.Tensor         # [B] int32, tokens in the cache before this step
    block_tables: torch.Tensor         # [B, max_blocks] int32 (paged_kv pages per sequence)
    slot_mapping: torch.Tensor         # [T] int64, flat K/V entry of each new token
    recurrent_slots: torch.Tensor      # [B] int64, recurrent_slot index per sequence
    has_initial_state: torch.Tensor    # [B] bool, False where the recurrent state starts at 0
    logits_indices: torch.Tensor       # [N] int64, rows whose next token is sampled
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    max_query_len: int = 1
    max_seq_len: int = 0
    # the one device buffer that the tensors above (and the step's token ids and positions)
    # view, copied in once (``qllm.runner.staging``); None for a batch built another way
    staged: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
