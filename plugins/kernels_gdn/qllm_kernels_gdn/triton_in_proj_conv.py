"""A Gated DeltaNet layer's decode input projection with the causal conv of its channels in the
same kernel (the ``in_proj_conv1d_update`` op; contract and reference: ``qllm.ops.gdn``).

In W3's one-token step the conv update is a kernel of its own between the input projection and
the recurrence (1.3 us a GDN layer on an H100's timeline, 2026-12-07, plus its kernel
boundary), for a few KB of work. The projection is qllm-kernels-linear's GEMV (one program per
``BLOCK_N`` output features, all of K; ``triton_gemv.gemv_tile``), and the conv is depthwise:
each of its channels is one output feature of the projection. So each GEMV program applies the
conv to the features it owns among the first ``C`` (the ``[q | k | v]`` channels) with
``triton_conv``'s update's steps (``carried_taps_sum``, ``shift_in``): the sequence's carried
taps (read after the GEMV's PDL wait, which keeps the GEMV's registers), the projected value
rounded to the output dtype as the new input, SiLU, and the slot shifted in place; a channel's
taps are read and written by the one thread that owns it.
The other features (``z``, ``b``, ``a``) are stored as projected.

Served where the GEMV serves the rows (``qllm_kernels_linear.ops.takes_gemv``: decode at a
handful of sequences); elsewhere the op is the projection, then ``triton_conv``'s update.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import launch_options, use_pdl
from qllm_kernels_gdn.triton_conv import carried_taps_sum, shift_in
from qllm_kernels_linear.configs import block_m
from qllm_kernels_linear.triton_gemv import gemv_config, gemv_tile


@triton.jit(do_not_specialize=["N"])
def _in_proj_conv_kernel(x_ptr, w_ptr, conv_w_ptr, state_ptr, slots_ptr, has_state_ptr,
                         out_ptr, M, N, K, C, stride_xm, stride_xk, stride_wn, stride_cw_chan,
                         stride_cw_tap, stride_s_slot, stride_s_chan, stride_s_tap, stride_om,
                         KERNEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[m, n] = silu(conv(taps of slots[m], round(x[m] . w[n])))`` for ``n < C``, else
    ``x[m] . w[n]``; shifts the taps of ``slots[m]`` (zeros where ``has_state[m]`` is
    False) for ``n < C``."""
    offs_m = tl.arange(0, BLOCK_M)  # [BM]: the sequences
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]: output features
    rows = offs_m < M
    channels = offs_n < C  # [BN]: the conv's
    projected = gemv_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, offs_m,
                          offs_n, BLOCK_M, BLOCK_N, BLOCK_K, WHOLE_K, NUM_STAGES,
                          USE_PDL).to(out_ptr.dtype.element_ty)  # [BM, BN], the op's rounding
    # After the GEMV (its PDL wait): the conv's reads. Before it they would hold registers
    # through the weight tile's load: 80 a thread at W3's in_proj (sm_90, Triton 3.7) instead
    # of the GEMV's own 64, so 6 programs a multiprocessor instead of 8 would hold their tiles
    # when the wait ends.
    slots = tl.load(slots_ptr + offs_m, mask=rows, other=0)  # [BM]
    has_state = tl.load(has_state_ptr + offs_m, mask=rows, other=0) != 0
    conv = rows[:, None] & channels[None, :]  # [BM, BN]
    taps = (state_ptr + slots[:, None].to(tl.int64) * stride_s_slot
            + offs_n[None, :] * stride_s_chan)  # [BM, BN] at tap 0, the oldest
    acc, last_weight = carried_taps_sum(
        taps, (conv_w_ptr + offs_n * stride_cw_chan)[None, :], conv & has_state[:, None],
        channels[None, :], stride_s_tap, stride_cw_tap, KERNEL)  # [BM, BN], [1, BN]
    acc += projected.to(tl.float32) * last_weight.to(tl.float32)
    shift_in(taps, projected, conv & has_state[:, None], conv, stride_s_tap, KERNEL)
    out = tl.where(channels[None, :], (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty),
                   projected)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out,
             mask=rows[:, None] & (offs_n < N)[None, :])


def in_proj_conv_update(x: torch.Tensor, weight: torch.Tensor, conv_weight: torch.Tensor,
                        conv_state: torch.Tensor, slots: torch.Tensor,
                        has_state: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (rows the GEMV serves) @ ``weight [N, K]^T`` (contiguous rows), the first
    ``C`` features through the conv (``conv_weight [C, KERNEL]``, ``conv_state [S + 1, C,
    KERNEL - 1]`` shifted in place at ``slots [M]``, zeros where ``has_state [M]`` is False)
    -> ``[M, N]`` in ``x.dtype``, at the GEMV's launch config for this shape."""
    (m, k), n = x.shape, weight.shape[0]
    config = gemv_config(m, n, k, x.device)
    pdl = use_pdl(x.device, m)
    out = x.new_empty(m, n)
    _in_proj_conv_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, weight, conv_weight, conv_state, slots, has_state, out, m, n, k,
        conv_weight.shape[0], x.stride(0), x.stride(1), weight.stride(0),
        conv_weight.stride(0), conv_weight.stride(1), conv_state.stride(0),
        conv_state.stride(1), conv_state.stride(2), out.stride(0), KERNEL=conv_weight.shape[1],
        BLOCK_M=block_m(m), BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        WHOLE_K=config.BLOCK_K >= k, NUM_STAGES=config.num_stages, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(pdl))
    return out
