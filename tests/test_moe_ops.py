"""The plain-torch MoE references (``qllm.ops.moe``): ``fused_moe``'s eager (grouped) and
compiled (dense) paths against a slot-by-slot computation, and ``moe_router``'s slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qllm.ops import moe

E, H, INTER, K = 6, 16, 8, 2


def naive_moe(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2):
    """Each slot's weighted expert output (expert ``E``: the shared one), ``[T, k, H]``, one
    (token, slot) at a time."""
    w13, w2 = torch.cat([w13, shared_w13[None]]), torch.cat([w2, shared_w2[None]])
    out = torch.zeros(*topk_ids.shape, x.shape[1])
    for t in range(x.shape[0]):
        for j, (weight, e) in enumerate(zip(topk_weights[t], topk_ids[t].tolist())):
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t, j] = weight * F.linear(F.silu(gate) * up, w2[e])
    return out


def routed_inputs(tokens: int, seed: int = 0):
    """Routing as the router gives it: top-``K`` of ``E`` routed experts, then the shared one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    weights, ids = moe.moe_router(torch.randn(tokens, E + 1, generator=gen), top_k=K,
                                  renormalize=True)
    shared_w13 = torch.randn(2 * INTER, H, generator=gen)
    shared_w2 = torch.randn(H, INTER, generator=gen)
    return x, w13, w2, weights, ids, shared_w13, shared_w2


@pytest.mark.parametrize("path", ["grouped", "dense"])
@pytest.mark.parametrize("tokens", [1, 5, 37], ids=lambda n: f"{n}-tokens")
def test_fused_moe_matches_slot_by_slot(monkeypatch, path, tokens):
    if path == "dense":  # the branch torch.compile takes, without paying for a compile
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    inputs = routed_inputs(tokens)
    torch.testing.assert_close(moe.fused_moe(*inputs), naive_moe(*inputs), atol=1e-4, rtol=1e-5)


def test_router_renormalises_top_k_in_fp32_then_adds_the_shared_expert():
    logits = torch.randn(3, E + 1)
    weights, ids = moe.moe_router(logits, top_k=K, renormalize=True)
    assert weights.shape == ids.shape == (3, K + 1)
    torch.testing.assert_close(weights[:, :K].sum(-1), torch.ones(3))
    torch.testing.assert_close(weights[:, K], logits[:, E].sigmoid())
    assert (ids[:, K] == E).all() and (ids[:, :K] < E).all()
