"""Fused Gated DeltaNet decode step (opt-in, ``QLLM_GDN_DECODE=fused``): the conv update, the
gated delta rule and the gated RMSNorm of one token per sequence in one launch, where the
default path runs three kernels (``_conv_update_kernel``, ``_gated_delta_rule_kernel``,
``_rms_norm_gated_kernel``: 2.1 + 3.0 + 2.2 us, each followed by a ~0.4 us gap, per GDN layer
at W3's batch 1 on the H200). Contract and reference: ``ops.gdn_decode_fused_reference``, the
composition of ``qllm.ops.gdn.causal_conv1d_update``, ``qllm.ops.gdn.gdn_decode`` and
``qllm.ops.norm.rms_norm_gated``.

Shapes (``B`` sequences, ``Hk`` key heads of ``dk``, ``Hv = GROUP * Hk`` value heads of
``dv``, conv width ``K``, ``C = 2 Hk dk + Hv dv`` channels ``[q | k | v]``): ``x [B, C]`` the
new tokens' conv inputs (unit channel stride), ``weight [C, K]``, ``conv_state [S + 1, C,
K - 1]`` and ``ssm_state [S + 1, Hv, dk, dv]`` (any strides; the models store the conv state
taps-outer and the SSM state value-major, key stride 1), ``a, b [B, Hv]``, ``A_log, dt_bias
[Hv]``, ``z [B, Hv, dv]`` (the norm's gate, unit last stride), ``norm_weight [dv]``; output
``[B, Hv, dv]`` in ``x``'s dtype.

Work split: one program per (key head, sequence), ``grid = (Hk, B)``. A program owns

- the ``2 dk`` q and k conv channels of its key head and the ``GROUP * dv`` v channels of the
  ``GROUP`` value heads that share it (value head ``h`` reads key head ``h // GROUP``);
- the ``GROUP`` ``[dk, dv]`` SSM state tiles of those value heads, held whole in registers in
  fp32, ``HEADS`` value heads at a time (``launch_config``: all ``GROUP`` in one ``[GROUP, dk,
  dv]`` tile, one contiguous block of the value-major slot, for a bf16 state; one for fp32);
- the ``GROUP`` output rows of ``dv``, so the RMSNorm's sum of squares is a reduction inside
  the program, never across programs.

Who writes which state: every conv channel and every SSM state element of a sequence's slot
belongs to exactly one program, which reads it and then writes it back; no program reads what
another writes, so the launch needs no ordering between programs. This is why a program covers
a whole key head and not one value head: the q/k conv taps of a key head are read by each of
its value heads, and with one program per value head one program could shift the taps in place
before its sibling had read them (no order between programs of one launch), so both would have
to read and neither could safely write. Within a program, a conv tap is read and rewritten by
the same thread (one layout for the loaded and the stored vector), as in ``triton_conv``.

Math in fp32, with the references' roundings kept: the conv outputs are rounded to ``x``'s
dtype (``causal_conv1d_update`` returns them so), the delta rule's output too (``gdn_decode``
returns ``v``'s dtype), and the norm follows ``triton_norm`` (``x_hat`` rounded, times the
weight rounded, times ``silu(z)`` in fp32). So the fused step gives the three-kernel path's
results up to fp32 summation order. Padding rows (padding slot, no state) read zeros and write
only the padding slot. The launch reads no host value: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's: above it, softplus(x) is x


@triton.jit
def _conv_channels(x_row, w_ptr, state, chans, mask, has_state,
                   stride_w_chan, stride_w_tap, stride_cs_chan, stride_cs_tap,
                   KERNEL: tl.constexpr):
    """Conv + SiLU of the new token on channels ``chans`` (any shape) and the shift of their
    taps in ``state`` (one slot); returns the output rounded to ``x``'s dtype, as fp32."""
    x = tl.load(x_row + chans, mask=mask, other=0.0)
    weight = w_ptr + chans * stride_w_chan
    taps = state + chans * stride_cs_chan  # tap 0 (oldest)
    acc = x.to(tl.float32) * tl.load(weight + (KERNEL - 1) * stride_w_tap, mask=mask,
                                     other=0.0).to(tl.float32)
    for j in tl.static_range(KERNEL - 1):
        tap = tl.load(taps + j * stride_cs_tap, mask=mask & has_state, other=0.0)
        acc += tap.to(tl.float32) * tl.load(weight + j * stride_w_tap, mask=mask,
                                            other=0.0).to(tl.float32)
        if j > 0:  # shift left by one: tap j moves to j - 1 (read above by this thread)
            tl.store(taps + (j - 1) * stride_cs_tap, tap, mask=mask)
    tl.store(taps + (KERNEL - 2) * stride_cs_tap,
             x.to(tl.float32).to(state.dtype.element_ty), mask=mask)
    out = acc * tl.sigmoid(acc)
    return out.to(x.dtype).to(tl.float32)


@triton.jit
def _state_tile(ssm_state_ptr, slot, key_head, tile, stride_s_slot, stride_s_head, stride_s_k,
                stride_s_v, GROUP: tl.constexpr, HEADS: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Pointers ``[HEADS, BK, BV]`` to the SSM state of value heads ``tile * HEADS ...`` of
    ``key_head``'s group, and their mask."""
    dims_g = tile * HEADS + tl.arange(0, HEADS)
    dims_k = tl.arange(0, BK)
    dims_v = tl.arange(0, BV)
    heads = key_head * GROUP + dims_g
    ptrs = (ssm_state_ptr + slot * stride_s_slot + heads[:, None, None] * stride_s_head
            + dims_k[None, :, None] * stride_s_k + dims_v[None, None, :] * stride_s_v)
    mask = ((dims_g < GROUP)[:, None, None] & (dims_k < DK)[None, :, None]
            & (dims_v < DV)[None, None, :])
    return ptrs, mask


@triton.jit
def _fused_decode_kernel(
    x_ptr, w_ptr, conv_state_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, ssm_state_ptr,
    z_ptr, norm_w_ptr, out_ptr, slots_ptr, has_state_ptr,
    scale, l2_eps, norm_eps,
    stride_x_tok, stride_w_chan, stride_w_tap,
    stride_cs_slot, stride_cs_chan, stride_cs_tap,
    stride_a_tok, stride_a_head, stride_b_tok, stride_b_head,
    stride_s_slot, stride_s_head, stride_s_k, stride_s_v,
    stride_z_tok, stride_z_head, stride_out_tok,
    NUM_K_HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    KERNEL: tl.constexpr, HEADS: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Grid ``(Hk, B)``; the ``GROUP`` value heads of a key head in tiles of ``HEADS`` (``BG``,
    all at once: both reads in flight together; or fewer, the registers of one tile)."""
    key_head = tl.program_id(0)
    seq = tl.program_id(1)
    dims_k = tl.arange(0, BK)
    dims_v = tl.arange(0, BV)
    mask_k = dims_k < DK
    mask_v = dims_v < DV
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_state = tl.load(has_state_ptr + seq)

    # The first state tile first: the largest read, in flight while the q/k conv runs.
    state, mask_s = _state_tile(ssm_state_ptr, slot, key_head, 0, stride_s_slot, stride_s_head,
                                stride_s_k, stride_s_v, GROUP, HEADS, BK, BV, DK, DV)
    h = tl.load(state, mask=mask_s & has_state, other=0.0).to(tl.float32)  # [HEADS, BK, BV]

    # Conv update of this key head's q and k channels; L2 norms and q's scale.
    x_row = x_ptr + seq.to(tl.int64) * stride_x_tok
    conv_state = conv_state_ptr + slot * stride_cs_slot
    q = _conv_channels(x_row, w_ptr, conv_state, key_head * DK + dims_k, mask_k, has_state,
                       stride_w_chan, stride_w_tap, stride_cs_chan, stride_cs_tap, KERNEL)
    k = _conv_channels(x_row, w_ptr, conv_state, (NUM_K_HEADS + key_head) * DK + dims_k,
                       mask_k, has_state, stride_w_chan, stride_w_tap, stride_cs_chan,
                       stride_cs_tap, KERNEL)  # [BK]
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps)
    k3 = k[None, :, None]
    kq = tl.sum(k * q, 0)
    dtype = out_ptr.dtype.element_ty
    norm_w = tl.load(norm_w_ptr + dims_v, mask=mask_v, other=0.0).to(tl.float32)

    for tile in tl.static_range(BG // HEADS):
        if tile > 0:
            state, mask_s = _state_tile(ssm_state_ptr, slot, key_head, tile, stride_s_slot,
                                        stride_s_head, stride_s_k, stride_s_v, GROUP, HEADS,
                                        BK, BV, DK, DV)
            h = tl.load(state, mask=mask_s & has_state, other=0.0).to(tl.float32)
        dims_g = tile * HEADS + tl.arange(0, HEADS)
        mask_g = dims_g < GROUP
        heads = key_head * GROUP + dims_g  # [HEADS]
        mask_gv = mask_g[:, None] & mask_v[None, :]  # [HEADS, BV]
        v_chans = 2 * NUM_K_HEADS * DK + heads[:, None] * DV + dims_v[None, :]
        v = _conv_channels(x_row, w_ptr, conv_state, v_chans, mask_gv, has_state,
                           stride_w_chan, stride_w_tap, stride_cs_chan, stride_cs_tap, KERNEL)

        # Gated delta rule (triton_recurrent's step): gates, decay, delta, output, update.
        a = tl.load(a_ptr + seq * stride_a_tok + heads * stride_a_head, mask=mask_g,
                    other=0.0).to(tl.float32)  # [HEADS]
        b = tl.load(b_ptr + seq * stride_b_tok + heads * stride_b_head, mask=mask_g,
                    other=0.0).to(tl.float32)
        decay_rate = tl.exp(tl.load(a_log_ptr + heads, mask=mask_g, other=0.0).to(tl.float32))
        shifted = a + tl.load(dt_bias_ptr + heads, mask=mask_g, other=0.0).to(tl.float32)
        softplus = tl.where(shifted > SOFTPLUS_THRESHOLD, shifted,
                            tl.log(1.0 + tl.exp(shifted)))
        decay = tl.exp(-decay_rate * softplus)  # [HEADS], exp(g)
        beta = tl.sigmoid(b)
        # o = (decay S + k delta^T)^T q = decay S^T q + delta (k . q): sums over the old state
        delta = beta[:, None] * (v - decay[:, None] * tl.sum(h * k3, 1))  # [HEADS, BV]
        o = decay[:, None] * tl.sum(h * q[None, :, None], 1) + delta * kq
        h = h * decay[:, None, None] + k3 * delta[:, None, :]
        tl.store(state, h.to(ssm_state_ptr.dtype.element_ty), mask=mask_s)

        # Gated RMSNorm of each value head's row (triton_norm's casts), o rounded as
        # gdn_decode returns it.
        o = o.to(dtype).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(o * o, 1) / DV + norm_eps)  # [HEADS]
        x_hat = (o * inv_rms[:, None]).to(dtype)
        weighted = (norm_w[None, :] * x_hat.to(tl.float32)).to(dtype)
        z = tl.load(z_ptr + seq * stride_z_tok + heads[:, None] * stride_z_head
                    + dims_v[None, :], mask=mask_gv, other=0.0).to(tl.float32)
        out = weighted.to(tl.float32) * (z * tl.sigmoid(z))
        tl.store(out_ptr + seq.to(tl.int64) * stride_out_tok + heads[:, None] * DV
                 + dims_v[None, :], out.to(dtype), mask=mask_gv)


def launch_config(num_seqs: int, num_k_heads: int, group: int, dk: int, dv: int,
                  state_dtype: torch.dtype) -> tuple[int, int]:
    """``(value heads per tile, warps)``. Warps: about 128 fp32 values of the key head's
    ``[GROUP, dk, dv]`` state per thread, 8 at most (Qwen3.5-35B-A3B: 8). A bf16 state takes
    the whole group in one tile (both state reads in flight at once: the shortest program at
    W3's batch 1, 16 programs; the most bytes in flight per SM at batch 200); an fp32 state one
    value head per tile (the group's tile spills under Triton 3.6).

    Chosen from the offline sm_90 compile at that geometry, not timed (registers / spill bytes,
    Triton 3.6.0 | 3.7.1): bf16 state, 2 heads x 8 warps 255 / 0 | 254 / 0 (4 warps spill, 16
    cap the registers at 128 and spill under 3.6); fp32 state, 1 head x 8 warps 255 / 0 | 255 /
    0 (2 heads x 8 spill 160 bytes under 3.6; 1 head x 16 warps: 128 / 0). ``test_fused_decode
    .py`` compiles these; ``bench_gdn.py --sweep-fused`` times them."""
    heads = triton.next_power_of_2(group) if state_dtype.itemsize <= 2 else 1
    values = triton.next_power_of_2(group) * triton.next_power_of_2(dk) * \
        triton.next_power_of_2(dv)
    return heads, max(1, min(8, values // (128 * 32)))


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_args(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                ssm_state: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, slots: torch.Tensor, has_state: torch.Tensor, out: torch.Tensor,
                heads: int) -> dict:
    """The kernel's arguments by name (the launch and the offline compile share them)."""
    num_v_heads, dk, dv = ssm_state.shape[1:]
    num_k_heads = (x.shape[1] - num_v_heads * dv) // (2 * dk)
    group = num_v_heads // num_k_heads
    return dict(
        x_ptr=x, w_ptr=weight, conv_state_ptr=conv_state, a_ptr=a, b_ptr=b,
        a_log_ptr=A_log, dt_bias_ptr=dt_bias, ssm_state_ptr=ssm_state, z_ptr=z,
        norm_w_ptr=norm_weight, out_ptr=out, slots_ptr=slots, has_state_ptr=has_state,
        scale=dk ** -0.5, l2_eps=L2NORM_EPS, norm_eps=eps,
        stride_x_tok=x.stride(0), stride_w_chan=weight.stride(0),
        stride_w_tap=weight.stride(1), stride_cs_slot=conv_state.stride(0),
        stride_cs_chan=conv_state.stride(1), stride_cs_tap=conv_state.stride(2),
        stride_a_tok=a.stride(0), stride_a_head=a.stride(1),
        stride_b_tok=b.stride(0), stride_b_head=b.stride(1),
        stride_s_slot=ssm_state.stride(0), stride_s_head=ssm_state.stride(1),
        stride_s_k=ssm_state.stride(2), stride_s_v=ssm_state.stride(3),
        stride_z_tok=z.stride(0), stride_z_head=z.stride(1), stride_out_tok=out.stride(0),
        NUM_K_HEADS=num_k_heads, GROUP=group, DK=dk, DV=dv, KERNEL=weight.shape[1],
        HEADS=min(heads, triton.next_power_of_2(group)), BG=triton.next_power_of_2(group), BK=triton.next_power_of_2(dk),
        BV=triton.next_power_of_2(dv))


def fused_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                 a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 ssm_state: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, slots: torch.Tensor, has_state: torch.Tensor,
                 heads: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One decode step of ``B = x.shape[0]`` sequences (shapes in the module docstring): the
    conv and SSM states of ``slots [B]`` updated in place (read as zeros where ``has_state
    [B]`` is False). Returns ``[B, Hv, dv]`` in ``x``'s dtype. ``heads`` (value heads per
    tile, a power of two) and ``num_warps`` override the launch configuration (for
    tuning)."""
    x, z = _unit_last_stride(x), _unit_last_stride(z)
    num_v_heads, dk, dv = ssm_state.shape[1:]
    num_k_heads = (x.shape[1] - num_v_heads * dv) // (2 * dk)
    if (x.shape[1] != 2 * num_k_heads * dk + num_v_heads * dv or num_k_heads == 0
            or num_v_heads % num_k_heads):
        raise ValueError(f"x [B, {x.shape[1]}] is not [q | k | v] of key heads of {dk} and "
                         f"{num_v_heads} value heads of {dv}")
    out = torch.empty(x.shape[0], num_v_heads, dv, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    default_heads, default_warps = launch_config(x.shape[0], num_k_heads,
                                                 num_v_heads // num_k_heads, dk, dv,
                                                 ssm_state.dtype)
    args = launch_args(x, weight, conv_state, a, b, A_log.contiguous(), dt_bias.contiguous(),
                       ssm_state, z, norm_weight.contiguous(), eps, slots, has_state, out,
                       heads or default_heads)
    _fused_decode_kernel[(num_k_heads, x.shape[0])](**args,
                                                    num_warps=num_warps or default_warps)
    return out
