"""The plugin's plain-torch ``fused_moe`` kernel, eager (grouped) and compiled (dense) paths,
against a slot-by-slot reference; the MoE input projection's layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

moe = pytest.importorskip("qllm_qwen3_5.moe")

E, H, INTER, K = 6, 16, 8, 2


def naive_moe(x, w13, w2, topk_weights, topk_ids):
    """The weighted sum of each token's experts, ``[T, H]``, one (token, slot) at a time."""
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t], topk_ids[t].tolist()):
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, w2[e])
    return out


def routed_inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    probs = torch.randn(tokens, E, generator=gen).softmax(-1)
    topk_weights, topk_ids = probs.topk(K, dim=-1)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("path", ["grouped", "dense"])
@pytest.mark.parametrize("tokens", [1, 5, 37], ids=lambda n: f"{n}-tokens")
def test_fused_moe_matches_slot_by_slot(monkeypatch, path, tokens):
    if path == "dense":  # the branch torch.compile takes, without paying for a compile
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    inputs = routed_inputs(tokens)
    torch.testing.assert_close(moe.fused_moe(*inputs), naive_moe(*inputs), atol=1e-4, rtol=1e-5)


def test_router_renormalises_top_k_in_fp32():
    weights, ids = moe.moe_router(torch.randn(3, E), top_k=K, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    assert ids.shape == (3, K)


def test_input_projection_shards_start_16_byte_aligned():
    """The packed router / shared-expert projection of the real geometry: its 1,281 rows are
    padded to a multiple of 8 with the one-row gate last, so the bf16 output rows and every
    wide shard start on 16 bytes (cuBLAS otherwise picks its slow ``align1`` kernels), and
    ``split`` drops the padding."""
    from transformers import Qwen3_5MoeTextConfig

    kernels = SimpleNamespace(moe_router=moe.moe_router, fused_moe=moe.fused_moe)
    with torch.device("meta"):
        block = moe.SparseMoeBlock(Qwen3_5MoeTextConfig(), kernels, renormalize=True)
    proj = block.input_proj
    assert proj.out_features == 1288
    assert [offset % 8 for offset, size in proj.shard_offsets.values() if size > 1] == [0, 0, 0]
    shards = proj.split(torch.zeros(3, proj.out_features))
    assert [s.shape[-1] for s in shards] == [256, 512, 512, 1]
