"""Depthwise causal conv1d + SiLU over the ``[q | k | v]`` channels, carrying each sequence's
last ``K - 1`` inputs in its recurrent slot (contract and reference: ``qllm.ops.gdn``).

State layout ``conv_state [S + 1, C, K - 1]``: slot ``slots[i]`` holds sequence ``i``'s last
``K - 1`` inputs, oldest first; where ``has_state[i]`` is False they read as zeros. Any
strides; with channel stride 1 (how the models store it) every tap of a block of channels is
one coalesced vector. Math in fp32; outputs in ``x.dtype``, state in its own dtype.

- ``conv1d_update`` (decode): one program per (sequence, block of channels) computes the new
  token's output and shifts the slot in place. A channel's taps are 1-D vectors of one layout,
  so the thread that reads a state element is the one that overwrites it: no race.
- ``conv1d_prefill``: one program per (block of tokens, sequence, block of channels); positions
  before a sequence's start read its slot. It writes q, k and v as three contiguous tensors:
  fla's chunked kernels copied each strided column view contiguous first (three copies of
  about 100 us per GDN layer in W2's 16,384-token prefill steps). Token blocks past a
  sequence's end return at once, so the grid depends on ``max_query_len`` alone, never on
  tensor values (no host sync). A second launch writes the new states once every conv program
  has read the old ones.

In small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) the decode kernel is
launched with programmatic dependent launch: it reads its slot, weights and taps, then waits
for the previous kernel (``qllm.plugins.pdl.pdl_wait``) before it reads ``x``; the prefill
kernels are not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait

UPDATE_BLOCK_C = 256
PREFILL_BLOCK_T = 32
PREFILL_BLOCK_C = 128


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, slots_ptr, has_state_ptr,
    num_channels,
    stride_x_tok, stride_x_chan, stride_w_chan, stride_w_tap,
    stride_s_slot, stride_s_chan, stride_s_tap, stride_out_tok,
    KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Before the PDL wait: the slot, the weights and the slot's taps (no kernel of a decode
    # step writes them before this one; qllm.plugins.pdl), their part of the sum computed.
    pdl_release(USE_PDL)
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    mask = chans < num_channels
    slot = tl.load(slots_ptr + seq)
    has_state = tl.load(has_state_ptr + seq)
    state = state_ptr + slot * stride_s_slot + chans * stride_s_chan  # [BC], tap 0 (oldest)
    weight = w_ptr + chans * stride_w_chan  # [BC]
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL - 1):
        tap = tl.load(state + j * stride_s_tap, mask=mask & has_state, other=0.0)  # [BC]
        acc += tap.to(tl.float32) * tl.load(weight + j * stride_w_tap, mask=mask,
                                            other=0.0).to(tl.float32)
    last_weight = tl.load(weight + (KERNEL - 1) * stride_w_tap, mask=mask, other=0.0)
    pdl_wait(USE_PDL)  # x is the in_proj's output; the state is shifted in place
    x = tl.load(x_ptr + seq * stride_x_tok + chans * stride_x_chan, mask=mask, other=0.0)
    acc += x.to(tl.float32) * last_weight.to(tl.float32)
    for j in tl.static_range(1, KERNEL - 1):  # shift left by one: tap j moves to j - 1
        tap = tl.load(state + j * stride_s_tap, mask=mask & has_state, other=0.0)  # cached
        tl.store(state + (j - 1) * stride_s_tap, tap, mask=mask)
    tl.store(state + (KERNEL - 2) * stride_s_tap,
             x.to(tl.float32).to(state_ptr.dtype.element_ty), mask=mask)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq * stride_out_tok + chans, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, state_ptr, out0_ptr, out1_ptr, out2_ptr, cu_seqlens_ptr, slots_ptr,
    has_state_ptr, num_channels, split1, split2,
    stride_x_tok, stride_x_chan, stride_w_chan, stride_w_tap,
    stride_s_slot, stride_s_chan, stride_s_tap,
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Channels ``[0, split1)`` go to ``out0`` (q), ``[split1, split2)`` to ``out1`` (k), the
    rest to ``out2`` (v), each a contiguous ``[T, group width]``."""
    block_t = tl.program_id(0)
    seq = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1) - bos
    if block_t * BLOCK_T >= length:
        return
    pos = block_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT], positions within the sequence
    chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    chan_mask = chans < num_channels
    slot = tl.load(slots_ptr + seq)
    has_state = tl.load(has_state_ptr + seq)
    state = state_ptr + slot * stride_s_slot + chans[None, :] * stride_s_chan  # [1, BC]

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        src = pos + (j - (KERNEL - 1))  # [BT], input position of tap j; < 0: carried state
        from_x = ((src >= 0) & (src < length))[:, None] & chan_mask[None, :]
        from_state = ((src < 0) & has_state)[:, None] & chan_mask[None, :]
        xv = tl.load(x_ptr + (bos + src)[:, None] * stride_x_tok + chans[None, :] * stride_x_chan,
                     mask=from_x, other=0.0)  # [BT, BC]
        sv = tl.load(state + (src + KERNEL - 1)[:, None] * stride_s_tap, mask=from_state,
                     other=0.0)  # [BT, BC]
        w = tl.load(w_ptr + chans * stride_w_chan + j * stride_w_tap, mask=chan_mask, other=0.0)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w.to(tl.float32)[None, :]
    out = acc * tl.sigmoid(acc)
    out_mask = (pos < length)[:, None] & chan_mask[None, :]
    # the part each channel belongs to: its first channel and width
    part_start = tl.where(chans >= split2, split2, tl.where(chans >= split1, split1, 0))  # [BC]
    part_width = tl.where(chans >= split2, num_channels - split2,
                          tl.where(chans >= split1, split2 - split1, split1))  # [BC]
    offset = (bos + pos)[:, None] * part_width[None, :] + (chans - part_start)[None, :]
    dst = tl.where((chans >= split2)[None, :], out2_ptr + offset,
                   tl.where((chans >= split1)[None, :], out1_ptr + offset, out0_ptr + offset))
    tl.store(dst, out.to(out0_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, cu_seqlens_ptr, slots_ptr, has_state_ptr,
    num_channels,
    stride_x_tok, stride_x_chan, stride_s_slot, stride_s_chan, stride_s_tap,
    KERNEL: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """New state of one sequence = its last ``K - 1`` inputs, reaching back into the old state
    when the sequence is shorter than that. Tap ``j`` reads old tap ``length + j > j`` (never
    one already rewritten) in the same thread that writes it."""
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    mask = chans < num_channels
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1) - bos
    slot = tl.load(slots_ptr + seq)
    has_state = tl.load(has_state_ptr + seq)
    state = state_ptr + slot * stride_s_slot + chans * stride_s_chan  # [BC]
    for j in tl.static_range(KERNEL - 1):
        src = length - (KERNEL - 1) + j  # input position that becomes tap j; < 0: old state
        xv = tl.load(x_ptr + (bos + src) * stride_x_tok + chans * stride_x_chan,
                     mask=mask & (src >= 0), other=0.0)
        sv = tl.load(state + (src + KERNEL - 1) * stride_s_tap,
                     mask=mask & (src < 0) & has_state, other=0.0)
        tl.store(state + j * stride_s_tap,
                 (xv.to(tl.float32) + sv.to(tl.float32)).to(state_ptr.dtype.element_ty),
                 mask=mask)


def conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  slots: torch.Tensor, has_state: torch.Tensor, block_c: int = UPDATE_BLOCK_C,
                  num_warps: int = 4) -> torch.Tensor:
    """``x [B, C]``, ``weight [C, K]``, ``conv_state [S + 1, C, K - 1]`` (shifted in place),
    ``slots [B]``, ``has_state [B]`` -> ``[B, C]`` in ``x.dtype``. ``block_c`` (channels per
    program) and ``num_warps`` override the launch configuration (for tuning)."""
    batch, channels = x.shape
    out = x.new_empty(batch, channels)
    grid = (batch, triton.cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x, weight, conv_state, out, slots, has_state,
        channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        KERNEL=weight.shape[1], BLOCK_C=block_c, num_warps=num_warps,
        **pdl_arguments(x.device, batch))
    return out


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   cu_seqlens: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                   max_query_len: int, split_sizes: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``x [T, C]`` of ``B`` sequences split at ``cu_seqlens [B + 1]``; ``weight``,
    ``conv_state``, ``slots``, ``has_state`` as in ``conv1d_update``; each slot ends holding
    its sequence's last ``K - 1`` inputs. Returns the three channel groups ``split_sizes``
    (q, k, v; summing to ``C``), each a contiguous ``[T, size]`` tensor in ``x.dtype``."""
    tokens, channels = x.shape
    if len(split_sizes) != 3 or sum(split_sizes) != channels:
        raise ValueError(f"split_sizes {split_sizes}: three groups summing to the {channels} "
                         f"channels")
    batch = slots.shape[0]
    q, k, v = (x.new_empty(tokens, size) for size in split_sizes)
    grid = (triton.cdiv(max_query_len, PREFILL_BLOCK_T), batch,
            triton.cdiv(channels, PREFILL_BLOCK_C))
    _conv_prefill_kernel[grid](
        x, weight, conv_state, q, k, v, cu_seqlens, slots, has_state,
        channels, split_sizes[0], split_sizes[0] + split_sizes[1],
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        KERNEL=weight.shape[1], BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=PREFILL_BLOCK_C, num_warps=4)
    _conv_state_kernel[(batch, triton.cdiv(channels, UPDATE_BLOCK_C))](
        x, conv_state, cu_seqlens, slots, has_state,
        channels,
        x.stride(0), x.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        KERNEL=weight.shape[1], BLOCK_C=UPDATE_BLOCK_C, num_warps=4)
    return q, k, v
