"""The MoE router's tail as one Triton program per token: fp32 softmax over the router
logits, top-k (largest first; the lower expert id wins a tie), optional renormalisation, then
the shared expert's slot (id ``E``, weight ``sigmoid`` of the gate logit that follows the
router's). Replaces a softmax, a top-k selection and sort, a division, a sigmoid and two
concatenations. Contract and reference: ``qllm.ops.moe.moe_router``. In small decode
steps (``qllm.plugins.pdl``) it is launched with programmatic dependent launch and waits for
the previous kernel at entry (``qllm.plugins.pdl.pdl_enter``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_enter

# One warp: the top-k passes' reductions stay in warp shuffles. On the H200 for 256 experts,
# 2.56 us per call at 1 token and 3.13 at 200, against 3.53 and 4.15 with 4 warps.
ROUTER_WARPS = 1


@triton.jit
def _router_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                   RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)  # the logits are the router GEMV's output
    row = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_row + experts, mask=valid,
                     other=-float("inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))  # 0 on the padding
    probs = exps / tl.sum(exps, axis=0)  # [E]
    ks = tl.arange(0, K_PAD)
    top_weights = tl.zeros([K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    remaining = tl.where(valid, probs, -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, experts, E_PAD), axis=0)
        top_weights = tl.where(ks == j, best, top_weights)
        top_ids = tl.where(ks == j, best_id.to(tl.int64), top_ids)
        remaining = tl.where(experts == best_id, -1.0, remaining)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)  # padding entries are 0
    shared_gate = tl.load(logits_ptr + row * stride_row + num_experts).to(tl.float32)
    top_weights = tl.where(ks == TOP_K, tl.sigmoid(shared_gate), top_weights)
    top_ids = tl.where(ks == TOP_K, num_experts, top_ids)
    out = row * (TOP_K + 1) + ks
    tl.store(weights_ptr + out, top_weights.to(weights_ptr.dtype.element_ty), mask=ks <= TOP_K)
    tl.store(ids_ptr + out, top_ids, mask=ks <= TOP_K)


def moe_router_triton(logits: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E + 1]`` (the router's, then the shared expert's gate) -> ``(weights
    [T, k + 1] in logits.dtype, ids [T, k + 1] int64)``."""
    tokens, num_experts = logits.shape[0], logits.shape[1] - 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = logits.new_empty(tokens, top_k + 1)
    ids = torch.empty(tokens, top_k + 1, dtype=torch.int64, device=logits.device)
    if tokens:
        _router_kernel[(tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k + 1), E_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, num_warps=ROUTER_WARPS, **pdl_arguments(logits.device, tokens))
    return weights, ids
