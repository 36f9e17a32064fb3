"""The MoE block's input projection layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qllm.ops import moe as moe_ops

moe = pytest.importorskip("qllm_qwen3_5.moe")


def test_input_projection_holds_router_then_shared_gate():
    """The packed router / shared-gate projection of the real geometry: the 257 rows (the
    shared gate right after the router, so the router op reads both as one view) are padded to
    a multiple of 8, so the bf16 output rows start on 16 bytes (cuBLAS otherwise picks its slow
    ``align1`` kernels)."""
    from transformers import Qwen3_5MoeTextConfig

    kernels = SimpleNamespace(moe_router=moe_ops.moe_router,
                              fused_moe=moe_ops.fused_moe, linear=F.linear)
    with torch.device("meta"):
        block = moe.SparseMoeBlock(Qwen3_5MoeTextConfig(), kernels, renormalize=True)
    proj = block.input_proj
    assert proj.out_features == 264
    assert proj.shard_offsets == {"router": (0, 256), "shared_expert_gate": (256, 1)}
