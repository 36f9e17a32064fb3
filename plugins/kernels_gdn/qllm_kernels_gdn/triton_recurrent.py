"""Fused recurrent gated delta rule that reads and updates each sequence's slot state in place
(contract and reference: ``qllm.ops.gdn``).

One program per (block of ``BV`` value dims, value head, sequence) holds its ``[dk, BV]`` slice
of the state in registers in fp32 (any state strides; the models store it value-major, so the
slice is one contiguous block) and walks the sequence's tokens in order; per token it
L2-normalises ``q`` and ``k`` of its key head (``head // (Hv / Hk)``: consecutive value heads
share a key head), scales ``q`` by ``dk ** -0.5``, computes its head's gates from the input
projection's ``a_t, b_t`` (``g_t = -exp(A_log) * softplus(a_t + dt_bias)``, ``beta_t =
sigmoid(b_t)``, in fp32; softplus as ``log(1 + exp(x))``, ``x`` itself above 20 like
``F.softplus``), and runs::

    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t (x) delta;  o_t = q_t^T S

(computed as ``o_t = exp(g_t) q_t^T S_old + delta (k_t . q_t)``: both sums over the old state).

The state is read from ``ssm_state[slots[i]]`` (zeros where ``has_state[i]`` is False) and the
final one written back to the same place, so decode needs no gather/scatter copies and no host
value: the launch depends on shapes only and is CUDA-graph capturable. Decode (one token per
sequence, token ``i`` of sequence ``i``) and varlen prefill (tokens split at ``cu_seqlens``)
share the kernel; prefill walks each sequence sequentially, the fallback where fla's chunked
kernels are missing.

With ``norm`` (the ``gdn_decode_gated_norm`` op in small decode steps) a program holds a whole
value head and puts each token's output through the layer's gated RMSNorm
(``triton_norm.gated_rms_norm``) before storing it, so the norm's own kernel does not run.

In steps of at most ``PDL_MAX_ROWS`` tokens (``qllm.plugins.pdl``: decode at small batch, the
shortest prefills) the kernel is launched with programmatic dependent launch and waits for the
previous kernel (``qllm.plugins.pdl.pdl_wait``): in decode after reading its slot, its state
tile and its head's parameters (no kernel of a decode step writes them before this one), in
prefill at entry (a step's checkpoint rounds run the kernel more than once on one state);
with the norm it reads the norm's weight before the wait too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait
from qllm_kernels_gdn.triton_norm import gated_rms_norm, rms_norm_gated

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's: above it, softplus(x) is x
MIN_PROGRAMS = 512  # below this many programs at the wider block, the narrower one fills the SMs
# A program holding a whole head's [dk, dv] tile (the fused norm), at Qwen3.5's 128 x 128 on
# 16 warps: 123 registers a thread with an fp32 state, 86 with bf16 (8 warps: 228 and 169, near
# where Triton 3.6 spilled the narrow fp32 tile; sm_90 compiles here, Triton 3.7)
NORM_NUM_WARPS = 16
# Decode steps of at most this many sequences run the recurrence and the layer's gated norm as
# one kernel (a program per value head); larger ones keep the narrow recurrence programs tuned
# for W2's batch 200 and the norm's own kernel. Set to the latency-bound steps (those launched
# with PDL); not measured yet.
FUSED_NORM_MAX_ROWS = 16


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr,
    cu_seqlens_ptr, slots_ptr, has_state_ptr, gate_ptr, norm_weight_ptr,
    scale, eps, norm_eps,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_a_tok, stride_a_head, stride_b_tok, stride_b_head,
    stride_out_tok, stride_out_head, stride_gate_tok, stride_gate_head,
    stride_s_slot, stride_s_head, stride_s_k, stride_s_v,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr, NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """With ``NORM`` (one block of ``BV >= DV`` value dims: a program holds a whole head) each
    token's output goes through the layer's gated RMSNorm before it is stored."""
    pdl_release(USE_PDL)
    if VARLEN:  # a prefill's rounds may write the state before this launch: wait at entry
        pdl_wait(USE_PDL)
    block_v = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if VARLEN:
        bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
        eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    else:
        bos = seq.to(tl.int64)
        eos = bos + 1
    key_head = head // GROUP
    dims_k = tl.arange(0, BK)
    dims_v = block_v * BV + tl.arange(0, BV)
    mask_k = dims_k < DK
    mask_v = dims_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]

    slot = tl.load(slots_ptr + seq)
    has_state = tl.load(has_state_ptr + seq)
    state = (state_ptr + slot * stride_s_slot + head * stride_s_head
             + dims_k[:, None] * stride_s_k + dims_v[None, :] * stride_s_v)  # [BK, BV]
    h = tl.load(state, mask=mask_s & has_state, other=0.0).to(tl.float32)  # [BK, BV]
    decay_rate = tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    if NORM:
        norm_weight = tl.load(norm_weight_ptr + dims_v, mask=mask_v, other=0.0)  # [BV]
    if not VARLEN:  # decode: the slot and its state read before the wait (qllm.plugins.pdl)
        pdl_wait(USE_PDL)  # q, k, v are the conv's output, a and b the in_proj's

    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_q_tok + key_head * stride_q_head + dims_k, mask=mask_k,
                    other=0.0).to(tl.float32)  # [BK]
        k = tl.load(k_ptr + t * stride_k_tok + key_head * stride_k_head + dims_k, mask=mask_k,
                    other=0.0).to(tl.float32)  # [BK]
        v = tl.load(v_ptr + t * stride_v_tok + head * stride_v_head + dims_v, mask=mask_v,
                    other=0.0).to(tl.float32)  # [BV]
        if NORM:  # the norm's gate, the in_proj's output (loaded with the other inputs)
            gate = tl.load(gate_ptr + t * stride_gate_tok + head * stride_gate_head + dims_v,
                           mask=mask_v, other=0.0)  # [BV]
        a = tl.load(a_ptr + t * stride_a_tok + head * stride_a_head).to(tl.float32)
        shifted = a + dt_bias
        softplus = tl.where(shifted > SOFTPLUS_THRESHOLD, shifted, tl.log(1.0 + tl.exp(shifted)))
        decay = tl.exp(-decay_rate * softplus)  # exp(g)
        beta = tl.sigmoid(tl.load(b_ptr + t * stride_b_tok + head * stride_b_head).to(tl.float32))
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)

        # Both reductions read the state before this token, the decay applied to their sums:
        # o = (decay S + k delta^T)^T q = decay S^T q + delta (k . q). One pass over the tile
        # for the two sums and one for the update, with no elementwise decay of its own.
        delta = beta * (v - decay * tl.sum(h * k[:, None], 0))  # [BV]
        o = decay * tl.sum(h * q[:, None], 0) + delta * tl.sum(k * q, 0)  # [BV]
        h = h * decay + k[:, None] * delta[None, :]
        if NORM:
            o = gated_rms_norm(o.to(out_ptr.dtype.element_ty), gate, norm_weight, norm_eps, DV)
        tl.store(out_ptr + t * stride_out_tok + head * stride_out_head + dims_v,
                 o.to(out_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=mask_s)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads q, k, v rows with stride 1 (a copy only for an unusual layout)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_config(num_seqs: int, num_heads: int, dv: int, state: torch.Tensor
                   ) -> tuple[int, int]:
    """``(value dims per program, warps)``, from ``bench_gdn.py --sweep-decode`` on the H200 at
    the Qwen3.5-35B-A3B geometry.

    Value-major state (key stride 1, as the models store it): bf16 8 value dims on one warp (a
    2 KB tile; at batch 200, consecutive slots: 112.1 us per layer, 114.4 at 16, 120.5 at
    128 x 8 warps; at batch 1: 6.5 us, 7.1 at 16 x 1, 2026-12-03); fp32 16 on 2 warps (218.4
    us at batch 200; 217.9 at 32 x 1, whose 32 x 128 fp32 tile per warp needs 254 registers a
    thread under Triton 3.7 and spills 32 bytes under the H200 image's 3.6; 240.9 at 16 x 1)
    (2026-11-30). Key-major
    (contiguous) state: where 32 value dims per program leave too few programs to fill the
    GPU, 16 with 2 warps; otherwise bf16 32 x 2 warps (142 us at batch 200; 149 at 64 x 4),
    fp32 64 x 4 warps (222 us; 231 at 32 x 2)."""
    if state.stride(-2) == 1 and state.dtype.itemsize > 2:
        block_v, num_warps = 16, 2
    elif state.stride(-2) == 1:
        block_v, num_warps = 8, 1
    elif num_seqs * num_heads * triton.cdiv(dv, 32) < MIN_PROGRAMS:
        block_v, num_warps = 16, 2
    elif state.dtype.itemsize <= 2:
        block_v, num_warps = 32, 2
    else:
        block_v, num_warps = 64, 4
    return min(block_v, triton.next_power_of_2(dv)), num_warps


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     ssm_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, block_v: int | None = None,
                     num_warps: int | None = None,
                     norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                     ) -> torch.Tensor:
    """``q, k [T, Hk, dk]`` raw, ``v [T, Hv, dv]``, gate inputs ``a, b [T, Hv]`` with
    ``A_log, dt_bias [Hv]``; ``ssm_state [S + 1, Hv, dk, dv]`` updated in place at
    ``slots [B]``. Without ``cu_seqlens`` (decode)
    ``T == B`` and token ``i`` belongs to sequence ``i``; with it, sequence ``i`` owns tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``. Returns ``o [T, Hv, dv]`` in ``v.dtype``, or in
    decode with ``norm = (gate [T, Hv, dv], weight [dv], eps)`` ``rms_norm_gated(o, gate,
    weight, eps)``, a program then holding a whole head (``NORM_NUM_WARPS``). ``block_v`` and ``num_warps``
    override the launch configuration (for tuning)."""
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    tokens, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    num_seqs = slots.shape[0]
    out = v.new_empty(tokens, num_v_heads, dv)
    if norm is None:
        gate, norm_weight, norm_eps = None, None, 0.0
        default_block_v, default_warps = _launch_config(num_seqs, num_v_heads, dv, ssm_state)
    else:
        gate, norm_weight, norm_eps = norm
        gate = _unit_last_stride(gate)
        default_block_v, default_warps = triton.next_power_of_2(dv), NORM_NUM_WARPS
    block_v, num_warps = block_v or default_block_v, num_warps or default_warps
    if norm is not None and (block_v < dv or cu_seqlens is not None):
        raise ValueError(f"gated_delta_rule applies the norm in decode, a whole head per "
                         f"program: got block_v {block_v} for dv {dv}"
                         + (" and cu_seqlens" if cu_seqlens is not None else ""))
    grid = (triton.cdiv(dv, block_v), num_v_heads, num_seqs)
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()  # [Hv], read at the head
    _gated_delta_rule_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, out, ssm_state,
        cu_seqlens, slots, has_state, gate, norm_weight,
        dk ** -0.5, L2NORM_EPS, norm_eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), *(gate.stride()[:2] if norm else (0, 0)),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2), ssm_state.stride(3),
        GROUP=num_v_heads // q.shape[1], DK=dk, DV=dv,
        BK=triton.next_power_of_2(dk), BV=block_v, VARLEN=cu_seqlens is not None,
        NORM=norm is not None, num_warps=num_warps, **pdl_arguments(v.device, tokens))
    return out


def decode_gated_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      ssm_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                      gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A decode step (``gated_delta_rule`` without ``cu_seqlens``), its output then through
    ``rms_norm_gated`` with ``gate [B, Hv, dv]``: in the recurrence's kernel up to
    ``FUSED_NORM_MAX_ROWS`` sequences, else by the norm's own kernel after it."""
    if v.shape[0] <= FUSED_NORM_MAX_ROWS:
        return gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state,
                                norm=(gate, norm_weight, eps))
    out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, has_state)
    return rms_norm_gated(out, gate, norm_weight, eps)
