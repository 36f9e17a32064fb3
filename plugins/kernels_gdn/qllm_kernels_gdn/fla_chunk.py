"""Chunked gated delta rule for prefill through fla's Triton kernels (``fla-core``, import name
``fla``; contract and reference: ``qllm.ops.gdn``).

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` does what qllm's ``gdn_prefill`` asks over
packed varlen sequences (``cu_seqlens``), after this plugin's L2 norm of q and k
(``triton_l2norm``, in place of fla's autotuned one), grouped value heads (value head ``h``
reads key head ``h // (Hv / Hk)``, the same consecutive sharing as ``repeat_interleave``),
``scale = dk ** -0.5``, chunks of 64 with the WY/UT transform on tensor cores, an fp32 initial
state per sequence and an fp32 final state. It takes and returns states by sequence, not by
slot, so this wrapper gathers the slots (zeros where a sequence starts fresh) and scatters the
final states back: one read and one write of ``B`` states, small next to the prefill itself.

fla derives the index of every chunk (sequence, chunk within it) from ``cu_seqlens``; on the
device that takes a ``repeat_interleave`` whose output size is read back to the host, a sync in
every GDN layer of a prefill step. This wrapper builds the same index from the host-side query
lengths the step already has (``chunk_indices``) and passes it in: no host sync.
"""

from __future__ import annotations

import functools

import torch

from qllm.ops.gdn import gdn_gates
from qllm_kernels_gdn.fla_configs import use_shipped_configs
from qllm_kernels_gdn.triton_l2norm import l2norm_heads

CHUNK_SIZE = 64  # tokens per chunk of fla's gated delta rule (its default)


def chunk_indices(query_lens: list[int], device: torch.device) -> torch.Tensor:
    """``[N, 2]`` int64: ``(sequence, chunk within the sequence)`` of every ``CHUNK_SIZE``
    chunk, in order; the index fla's ``prepare_chunk_indices`` derives from ``cu_seqlens``."""
    pairs = [(seq, chunk) for seq, length in enumerate(query_lens)
             for chunk in range(-(-length // CHUNK_SIZE))]
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(device, non_blocking=True)


@functools.cache
def _fla_chunk_rule(device_index: int):
    """fla's ``chunk_gated_delta_rule``, imported once fla has been pointed at the configs
    this plugin ships for the GPU (``fla_configs``): the lookup runs once per process."""
    use_shipped_configs(torch.cuda.get_device_name(device_index))
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                  b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  ssm_state: torch.Tensor, cu_seqlens: torch.Tensor, query_lens: list[int],
                  slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """``q, k [T, Hk, dk]`` raw, ``v [T, Hv, dv]``, gate inputs ``a, b [T, Hv]`` with
    ``A_log, dt_bias [Hv]`` (the gates computed by ``qllm.ops.gdn.gdn_gates``; fla takes them
    ready), sequences split at ``cu_seqlens [B + 1]`` (their lengths ``query_lens`` on the
    host); ``ssm_state [S + 1, Hv, dk, dv]`` read and written at ``slots [B]``. Returns
    ``o [T, Hv, dv]`` in ``v.dtype``. fla's autotuned kernels take the configs this plugin
    ships for the GPU where it has them (``fla_configs``)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fla's chunked prefill of {q.shape[0]} tokens cannot run in a CUDA graph: its "
            f"chunk index comes from the host's query lengths, which a replay would not "
            f"refresh; keep prefill_cudagraph_token_sizes at or below the steps that take "
            f"the recurrent kernel")
    chunk_gated_delta_rule = _fla_chunk_rule(q.device.index if q.device.index is not None
                                             else torch.cuda.current_device())
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [T, Hv] fp32 each
    initial = torch.where(has_state[:, None, None, None], ssm_state[slots].float(), 0.0)
    # fla memoises index tensors derived from cu_seqlens by object identity: a fresh tensor per
    # call keeps a caller's in-place reuse of query_start_loc from hitting a stale entry.
    cu_seqlens = cu_seqlens.to(torch.int64, copy=True)
    q, k = l2norm_heads(q), l2norm_heads(k)  # [T, Hk, dk] each, contiguous
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None].to(v.dtype), initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices(query_lens, q.device), chunk_size=CHUNK_SIZE)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))  # final: [B, Hv, dk, dv] fp32
    return out[0].to(v.dtype)
