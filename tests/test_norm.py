"""RMSNorm with a residual: the same values as eager ``x + residual``, and under
``torch.compile`` the add stays in the norm's kernel rather than joining the matmul before it."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qllm.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_residual_add_equals_plain_add(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(16, 64, generator=gen).to(dtype) for _ in range(2))
    norm = RMSNorm(64).to(dtype)
    normed, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, norm(x + residual))


def test_compiled_residual_add_is_not_fused_into_the_matmul():
    """inductor rewrites ``mm(a, w) + residual`` into ``addmm``; on the GPU cuBLAS then copies
    the residual into the output first (a ``memcpy32_post`` per layer in the H200 traces)."""
    proj = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    norm = RMSNorm(64).to(torch.bfloat16)
    compiled = torch.compile(lambda x, residual: norm(proj(x), residual), dynamic=True,
                             fullgraph=True)
    x, residual = torch.randn(8, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    with torch.no_grad():
        _, code = run_and_get_code(compiled, x, residual)
    source = "\n".join(code)
    assert "extern_kernels.mm" in source and "addmm" not in source
