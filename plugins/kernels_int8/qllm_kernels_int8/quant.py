"""Plain-torch quantization, dequantization and the reference ops (the kernels' oracle, and
what serves on CPU).

- INT8 weight-only (W8A16): ``q [N, K] int8`` and ``scale [N] fp32`` per output channel
  (symmetric, ``scale = amax(|w_n|) / 127``); ``w = q * scale``. The scale factors out of
  each output's sum, so kernels multiply it in their epilogue.
- FP8 block-scaled: ``q [N, K] float8_e4m3fn`` and ``scale_inv [ceil(N/bn), ceil(K/bk)]
  fp32`` per ``bn x bk`` block (Qwen's / DeepSeek's ``weight_scale_inv``; ``scale_inv =
  amax(|block|) / 448``); ``w = q * scale_inv``. Activations are quantized per token and group
  of ``bk`` columns the same way (``quantize_fp8_groups``) by the W8A8 kernels.

The reference ops dequantize the weights to fp32, round them once to the activations' dtype
and compute as the full-precision op would: on CPU a model in an 8-bit format computes
exactly what the same model with the dequantized weights computes. (The fp8 reference does
not quantize activations; the Triton W8A8 kernels do, see ``linear_fp8_w8a8_reference``.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm.ops.activation import silu_and_mul
from qllm.ops.moe import ExpertWeights, grouped_moe

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 1e-12  # an all-zero row or block keeps a positive scale


# ----------------------------------------------------------------------------- int8


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (any float dtype) -> ``(q [..., N, K] int8, scale [..., N] fp32)``,
    symmetric per row: ``q = round(w / scale)``, ``scale = amax(|row|) / 127``."""
    w = w.float()
    scale = (w.abs().amax(dim=-1) / INT8_MAX).clamp(min=MIN_SCALE)
    q = torch.round(w / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., N, K]``, ``scale [..., N]`` -> ``q * scale`` in fp32, rounded to ``dtype``."""
    return (q.float() * scale[..., None].float()).to(dtype)


# ----------------------------------------------------------------------------- fp8


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], rows: int,
                   cols: int) -> torch.Tensor:
    """``scale [..., ceil(rows/bn), ceil(cols/bk)]`` -> one value per element ``[..., rows,
    cols]``."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[
        ..., :rows, :cols]


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(q [..., N, K] e4m3, scale_inv [..., ceil(N/bn), ceil(K/bk)]
    fp32)`` with ``scale_inv = amax(|block|) / 448``."""
    bn, bk = block
    *lead, rows, cols = w.shape
    nb, kb = -(-rows // bn), -(-cols // bk)
    padded = F.pad(w.float(), (0, kb * bk - cols, 0, nb * bn - rows))
    blocks = padded.view(*lead, nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=MIN_SCALE)  # [..., nb, kb]
    q = (w.float() / _expand_blocks(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., N, K]``, ``scale_inv [..., ceil(N/bn), ceil(K/bk)]`` -> ``q * scale_inv`` in
    fp32, rounded to ``dtype``."""
    rows, cols = q.shape[-2:]
    return (q.float() * _expand_blocks(scale_inv.float(), block, rows, cols)).to(dtype)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: ``x [M, K]`` -> ``(q [M, K] e4m3, scale [M,
    ceil(K/group)] fp32)`` per token and group of ``group`` columns."""
    q, scale = quantize_fp8_blocks(x, (1, group))
    return q, scale


# ----------------------------------------------------------------------------- dense ops


def linear_w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """The ``linear_w8a16`` op: ``x [..., K]``, ``weight [N, K] int8``, ``scale [N] fp32``,
    ``bias [N]`` or ``None`` -> ``x @ (weight * scale).T + bias``, ``[..., N]`` in
    ``x.dtype``."""
    return F.linear(x, dequantize_int8_rows(weight, scale, x.dtype), bias)


def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """The ``linear_fp8_block`` op: ``x [..., K]``, ``weight [N, K] e4m3``, ``scale_inv
    [ceil(N/block_n), ceil(K/block_k)] fp32``, ``bias [N]`` or ``None`` -> ``x @ (weight *
    scale_inv).T + bias``, ``[..., N]`` in ``x.dtype``. Reference: weight-only (the
    activations are not quantized)."""
    return F.linear(x, dequantize_fp8_blocks(weight, scale_inv, (block_n, block_k), x.dtype),
                    bias)


def linear_fp8_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                              bias: torch.Tensor | None, block_n: int,
                              block_k: int) -> torch.Tensor:
    """What the Triton W8A8 GEMM computes, in fp32: ``x [M, K]`` quantized per token and
    group of ``block_k`` (``quantize_fp8_groups``), times the dequantized weight, plus bias,
    rounded to ``x.dtype``."""
    xq, xs = quantize_fp8_groups(x, block_k)
    x_deq = dequantize_fp8_blocks(xq, xs, (1, block_k))
    out = x_deq @ dequantize_fp8_blocks(weight, scale_inv, (block_n, block_k)).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- MoE ops


def _grouped_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int, expert_weights: ExpertWeights) -> torch.Tensor:
    """The ``fused_moe`` contract on weights given per expert (``qllm.ops.moe``): eagerly
    only the experts hit are dequantized (host sync); under ``torch.compile`` every expert
    runs on every token (static shapes)."""
    if not torch.compiler.is_compiling():
        return grouped_moe(x, topk_weights, topk_ids, num_experts, expert_weights)
    out = x.new_zeros(*topk_ids.shape, x.shape[1])
    for e in range(num_experts + 1):
        w13, w2 = expert_weights(e)
        expert_out = F.linear(silu_and_mul(F.linear(x, w13)), w2)  # [T, H]
        out = out + torch.where((topk_ids == e)[..., None], expert_out[:, None], 0.0)
    return out * topk_weights.to(x.dtype)[..., None]


def fused_moe_w8a16(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, shared_w13: torch.Tensor,
                    shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
                    shared_w2_scale: torch.Tensor) -> torch.Tensor:
    """The ``fused_moe_w8a16`` op: qllm's ``fused_moe`` contract (``x [T, H]``, routing
    ``[T, k]``, the shared expert as id ``E`` -> per-slot outputs ``[T, k, H]``) on int8
    experts ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with per-row scales ``w13_scale [E, 2I]``
    / ``w2_scale [E, H]``, and the shared expert's ``[2I, H]`` / ``[H, I]`` with ``[2I]`` /
    ``[H]``."""
    num_experts = w13.shape[0]

    def expert_weights(e):
        if e == num_experts:
            return (dequantize_int8_rows(shared_w13, shared_w13_scale, x.dtype),
                    dequantize_int8_rows(shared_w2, shared_w2_scale, x.dtype))
        return (dequantize_int8_rows(w13[e], w13_scale[e], x.dtype),
                dequantize_int8_rows(w2[e], w2_scale[e], x.dtype))

    return _grouped_moe(x, topk_weights, topk_ids, num_experts, expert_weights)


def fused_moe_fp8_block(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, shared_w13: torch.Tensor,
                        shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
                        shared_w2_scale: torch.Tensor, block_n: int,
                        block_k: int) -> torch.Tensor:
    """The ``fused_moe_fp8_block`` op: ``fused_moe_w8a16``'s contract on e4m3 experts with
    block scales ``w13_scale [E, ceil(2I/bn), ceil(H/bk)]``, ``w2_scale [E, ceil(H/bn),
    ceil(I/bk)]`` (the shared expert's without the ``E``). Reference: weight-only."""
    num_experts, block = w13.shape[0], (block_n, block_k)

    def expert_weights(e):
        if e == num_experts:
            return (dequantize_fp8_blocks(shared_w13, shared_w13_scale, block, x.dtype),
                    dequantize_fp8_blocks(shared_w2, shared_w2_scale, block, x.dtype))
        return (dequantize_fp8_blocks(w13[e], w13_scale[e], block, x.dtype),
                dequantize_fp8_blocks(w2[e], w2_scale[e], block, x.dtype))

    return _grouped_moe(x, topk_weights, topk_ids, num_experts, expert_weights)


def fused_moe_fp8_w8a8_reference(x: torch.Tensor, w13, w13_scale, w2, w2_scale,
                                 topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                 shared_w13, shared_w13_scale, shared_w2, shared_w2_scale,
                                 block_n: int, block_k: int) -> torch.Tensor:
    """What the Triton W8A8 MoE computes, in fp32: ``x`` quantized per token and group of
    ``block_k``, each slot's ``silu(gate) * up`` rounded to ``x.dtype`` and quantized the same
    way before the down projection; outputs rounded to ``x.dtype``. Every step is per row, so
    each expert hit runs once on the rows of its slots."""
    block, num_experts = (block_n, block_k), w13.shape[0]
    x_deq = dequantize_fp8_blocks(*quantize_fp8_groups(x, block_k), (1, block_k))  # [T, H]
    out = torch.empty(*topk_ids.shape, x.shape[1], device=x.device)  # [T, k, H]
    for e in topk_ids.unique().tolist():
        tokens, j = (topk_ids == e).nonzero(as_tuple=True)  # the slots routed to ``e``
        gate_up = (shared_w13, shared_w13_scale) if e == num_experts else (w13[e], w13_scale[e])
        down = (shared_w2, shared_w2_scale) if e == num_experts else (w2[e], w2_scale[e])
        gate, up = (x_deq[tokens] @ dequantize_fp8_blocks(*gate_up, block).T).chunk(2, dim=-1)
        hidden = (F.silu(gate) * up).to(x.dtype)  # [n, I]
        hidden = dequantize_fp8_blocks(*quantize_fp8_groups(hidden, block_k), (1, block_k))
        out[tokens, j] = (hidden @ dequantize_fp8_blocks(*down, block).T) \
            * topk_weights[tokens, j].float()[:, None]
    return out.to(x.dtype)
