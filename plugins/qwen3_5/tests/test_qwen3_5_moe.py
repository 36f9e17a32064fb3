"""The MoE block's input projection layout, and the block after the residual add and norm
(the ``add_rms_norm_linear`` op) against the norm then the block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qllm.layers.norm import RMSNorm
from qllm.ops import linear as linear_ops
from qllm.ops import moe as moe_ops

moe = pytest.importorskip("qllm_qwen3_5.moe")


REFERENCE_KERNELS = SimpleNamespace(moe_router=moe_ops.moe_router, fused_moe=moe_ops.fused_moe,
                                    linear=F.linear,
                                    add_rms_norm_linear=linear_ops.add_rms_norm_linear)


def test_input_projection_holds_router_then_shared_gate():
    """The packed router / shared-gate projection of the real geometry: the 257 rows (the
    shared gate right after the router, so the router op reads both as one view) are padded to
    a multiple of 8, so the bf16 output rows start on 16 bytes (cuBLAS otherwise picks its slow
    ``align1`` kernels)."""
    from transformers import Qwen3_5MoeTextConfig

    with torch.device("meta"):
        block = moe.SparseMoeBlock(Qwen3_5MoeTextConfig(), REFERENCE_KERNELS,
                                   renormalize=True)
    proj = block.input_proj
    assert proj.out_features == 264
    assert proj.shard_offsets == {"router": (0, 256), "shared_expert_gate": (256, 1)}


def test_after_add_norm_is_the_norm_then_the_block():
    """``after_add_norm`` (the add, the norm and the router's projection through one op) gives
    the bits of the decoder layer's norm followed by the block, and the same residual."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(hidden_size=64, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    block = moe.SparseMoeBlock(config, REFERENCE_KERNELS, renormalize=True)
    norm = RMSNorm(config.hidden_size, 1e-6, zero_centered=True)
    for parameter in (*block.parameters(), *norm.parameters()):
        parameter.data.normal_(0, 0.2)
    branch, residual = torch.randn(2, 5, config.hidden_size).unbind(0)
    out, summed = block.after_add_norm(branch, residual, norm)
    normed, expected_sum = norm(branch, residual)
    assert torch.equal(summed, expected_sum)
    assert torch.equal(out, block(normed))
