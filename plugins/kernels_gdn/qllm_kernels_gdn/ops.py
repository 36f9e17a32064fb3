"""The kernels as ``torch.library`` custom ops (namespace ``qllm_gdn``), and the functions
registered for qllm's ops, which unpack the ``ForwardBatch`` into them.

A custom op is opaque to ``torch.compile``: its fake implementation gives the output's shape
and ``mutates_args`` names the state it updates in place, so a ``fullgraph=True`` decode graph
stays whole and calls each kernel as one node. The ops and their fakes exist without Triton or
fla; the kernels are imported on the first real call.
"""

from __future__ import annotations

import torch

from qllm.batch import ForwardBatch


# ----------------------------------------------------------------------------- causal conv1d

@torch.library.custom_op("qllm_gdn::conv1d_update", mutates_args=("conv_state",))
def conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """Conv + SiLU of one token per sequence, ``x [B, C]`` -> ``[B, C]``; shifts the slots."""
    from qllm_kernels_gdn.triton_conv import conv1d_update as launch

    return launch(x, weight, conv_state, slots, has_state)


@conv1d_update.register_fake
def _conv1d_update_fake(x, weight, conv_state, slots, has_state):
    return x.new_empty(x.shape)


@torch.library.custom_op("qllm_gdn::conv1d_prefill", mutates_args=("conv_state",))
def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   cu_seqlens: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                   max_query_len: int, split_sizes: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv + SiLU over packed varlen tokens, ``x [T, C]`` -> the three channel groups
    ``split_sizes`` (q, k, v), each a contiguous ``[T, size]``; refills the slots."""
    from qllm_kernels_gdn.triton_conv import conv1d_prefill as launch

    return launch(x, weight, conv_state, cu_seqlens, slots, has_state, max_query_len,
                  split_sizes)


@conv1d_prefill.register_fake
def _conv1d_prefill_fake(x, weight, conv_state, cu_seqlens, slots, has_state, max_query_len,
                         split_sizes):
    q_size, k_size, v_size = split_sizes
    return (x.new_empty(x.shape[0], q_size), x.new_empty(x.shape[0], k_size),
            x.new_empty(x.shape[0], v_size))


# ----------------------------------------------------------------------------- gated delta rule

@torch.library.custom_op("qllm_gdn::recurrent_decode", mutates_args=("ssm_state",))
def recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     ssm_state: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor) -> torch.Tensor:
    """One recurrent step per sequence, ``v [B, Hv, dv]`` -> ``o [B, Hv, dv]``, the gates
    computed in the kernel; updates the slots in place."""
    from qllm_kernels_gdn.triton_recurrent import gated_delta_rule

    return gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state)


@recurrent_decode.register_fake
def _recurrent_decode_fake(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state):
    return v.new_empty(v.shape)


@torch.library.custom_op("qllm_gdn::recurrent_decode_gated_norm", mutates_args=("ssm_state",))
def recurrent_decode_gated_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                                dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                                slots: torch.Tensor, has_state: torch.Tensor, gate: torch.Tensor,
                                norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``recurrent_decode``, its output then through the gated RMSNorm with ``gate [B, Hv,
    dv]`` (one kernel in small steps: ``triton_recurrent.decode_gated_norm``)."""
    from qllm_kernels_gdn.triton_recurrent import decode_gated_norm

    return decode_gated_norm(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state,
                             gate, norm_weight, eps)


@recurrent_decode_gated_norm.register_fake
def _recurrent_decode_gated_norm_fake(q, k, v, a, b, A_log, dt_bias, ssm_state, slots,
                                      has_state, gate, norm_weight, eps):
    return v.new_empty(v.shape)


@torch.library.custom_op("qllm_gdn::recurrent_prefill", mutates_args=("ssm_state",))
def recurrent_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      ssm_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                      has_state: torch.Tensor) -> torch.Tensor:
    """Token-by-token gated delta rule over packed varlen sequences, ``v [T, Hv, dv]`` ->
    ``o [T, Hv, dv]``, the gates computed in the kernel; updates the slots in place."""
    from qllm_kernels_gdn.triton_recurrent import gated_delta_rule

    return gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state,
                            cu_seqlens)


@recurrent_prefill.register_fake
def _recurrent_prefill_fake(q, k, v, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots,
                            has_state):
    return v.new_empty(v.shape)


@torch.library.custom_op("qllm_gdn::fla_chunk_prefill", mutates_args=("ssm_state",))
def fla_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      ssm_state: torch.Tensor, cu_seqlens: torch.Tensor, query_lens: list[int],
                      slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """fla's chunked gated delta rule over packed varlen sequences, ``v [T, Hv, dv]`` ->
    ``o [T, Hv, dv]``; reads and writes the slots. ``query_lens``: the sequences' lengths on
    the host (``cu_seqlens``' differences), from which the chunk index is built sync-free."""
    from qllm_kernels_gdn.fla_chunk import chunk_prefill

    return chunk_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, cu_seqlens, query_lens,
                         slots, has_state)


@fla_chunk_prefill.register_fake
def _fla_chunk_prefill_fake(q, k, v, a, b, A_log, dt_bias, ssm_state, cu_seqlens, query_lens,
                            slots, has_state):
    return v.new_empty(v.shape)


# ----------------------------------------------------------------------------- gated RMSNorm

@torch.library.custom_op("qllm_gdn::rms_norm_gated", mutates_args=())
def rms_norm_gated_heads(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """``(weight * x_hat) * silu(gate)`` per head, ``x, gate [T, H, D]`` -> ``[T, H, D]``."""
    from qllm_kernels_gdn.triton_norm import rms_norm_gated as launch

    return launch(x, gate, weight, eps)


@rms_norm_gated_heads.register_fake
def _rms_norm_gated_heads_fake(x, gate, weight, eps):
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------- qllm's ops

def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         batch: ForwardBatch) -> torch.Tensor:
    """``causal_conv1d_update`` for qllm (see ``qllm.ops.gdn``); tensor-only."""
    cache = batch.caches["recurrent_slot"]
    return conv1d_update(x, weight, conv_state, cache.slots, cache.has_initial_state)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                          batch: ForwardBatch, split_sizes: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``causal_conv1d_prefill`` for qllm (see ``qllm.ops.gdn``); no host sync."""
    cache = batch.caches["recurrent_slot"]
    return conv1d_prefill(x, weight, conv_state, batch.query_start_loc, cache.slots,
                          cache.has_initial_state, batch.max_query_len, split_sizes)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``gdn_decode`` for qllm (see ``qllm.ops.gdn``); tensor-only, CUDA-graph capturable."""
    cache = batch.caches["recurrent_slot"]
    return recurrent_decode(q, k, v, a, b, A_log, dt_bias, ssm_state, cache.slots,
                            cache.has_initial_state)


def gdn_decode_gated_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          ssm_state: torch.Tensor, batch: ForwardBatch, gate: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gdn_decode_gated_norm`` for qllm (see ``qllm.ops.gdn``); tensor-only, CUDA-graph
    capturable."""
    cache = batch.caches["recurrent_slot"]
    return recurrent_decode_gated_norm(q, k, v, a, b, A_log, dt_bias, ssm_state, cache.slots,
                                       cache.has_initial_state, gate, norm_weight, eps)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``gdn_prefill`` for qllm through the recurrent Triton kernel (the fallback to fla)."""
    cache = batch.caches["recurrent_slot"]
    return recurrent_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, batch.query_start_loc,
                             cache.slots, cache.has_initial_state)


# Prefill steps of at most this many tokens take the recurrent kernel even where fla is
# installed: at W3's 512-token prompt the whole prefill step took 50 ms with it against 118 ms
# with fla's chunked kernels (H200, 2026-11-30; fla's per-call work, about 2.3 ms per GDN layer,
# dominates a short step); W2's 16,384-token steps are faster with fla (3.01 s of prefill
# against 4.16 s).
RECURRENT_PREFILL_MAX_TOKENS = 512


def fla_gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``gdn_prefill`` for qllm through fla's chunked kernels (the recurrent kernel for steps
    of up to ``RECURRENT_PREFILL_MAX_TOKENS`` tokens); no host sync."""
    if q.shape[0] <= RECURRENT_PREFILL_MAX_TOKENS:
        return gdn_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    cache = batch.caches["recurrent_slot"]
    return fla_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ssm_state, batch.query_start_loc,
                             batch.query_lens_host, cache.slots, cache.has_initial_state)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """``rms_norm_gated`` for qllm (see ``qllm.ops.norm``): ``x, gate [..., D]``, the leading
    dims taken as ``[T, H]`` (the layer's ``[T, Hv, dv]``; any token and head strides)."""
    x3, gate3 = (t if t.dim() == 3 else t.reshape(-1, 1, t.shape[-1]) for t in (x, gate))
    x3, gate3 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x3, gate3))
    return rms_norm_gated_heads(x3, gate3, weight, eps).view(x.shape)
