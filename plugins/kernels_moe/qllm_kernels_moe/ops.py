"""The Triton fused MoE and router as ``torch.library`` custom ops, ``qllm_moe::fused_moe`` and
``qllm_moe::moe_router``.

A custom op is opaque to ``torch.compile``: its fake implementation gives the output's shape,
so a ``fullgraph=True`` decode graph (with a symbolic batch size) stays whole and calls the
kernel as one node. Inside the op the token count is concrete, so the block-size table and
the sort's padded sizes are resolved per call. The op and its fake exist without Triton; the
kernels are imported on the first real call.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("qllm_moe::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_w13: torch.Tensor,
              shared_w2: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, the shared expert (id ``E``) ``shared_w13 [2I, H]`` and ``shared_w2
    [H, I]``, ``topk_weights`` / ``topk_ids`` ``[T, k]`` -> each slot's expert output times
    its routing weight, ``[T, k, H]`` in ``x.dtype``; the contract of qllm's ``fused_moe`` op
    (plain-torch reference in ``qllm.ops.moe``)."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton

    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2)


@fused_moe.register_fake
def _fused_moe_fake(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2):
    return x.new_empty(x.shape[0], topk_ids.shape[1], x.shape[1])


@torch.library.custom_op("qllm_moe::moe_router", mutates_args=())
def moe_router(logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits then the shared expert's gate logit, ``[T, E + 1]`` -> ``(weights
    [T, k + 1] in logits.dtype, ids [T, k + 1] int64)``: softmax over the ``E`` in fp32, top-k,
    optional renormalisation, then the shared expert (id ``E``) weighted ``sigmoid(gate)``; the
    contract of qllm's ``moe_router`` op (plain-torch reference in ``qllm.ops.moe``)."""
    from qllm_kernels_moe.triton_router import moe_router_triton

    return moe_router_triton(logits, top_k, renormalize)


@moe_router.register_fake
def _moe_router_fake(logits, top_k, renormalize):
    tokens = logits.shape[0]
    return (logits.new_empty(tokens, top_k + 1),
            logits.new_empty(tokens, top_k + 1, dtype=torch.int64))
