"""qllm plugin entry point: registers the Triton ``fused_moe`` and ``moe_router`` through
``qllm_kernels``.

``triton`` (priority 10, above the plain-torch references' 0) serves both ops on CUDA in
fp16/bf16 when Triton is importable.
"""

from __future__ import annotations

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import KernelSpec, triton_on_cuda
from qllm_kernels_moe import ops


@hookimpl
def qllm_kernels():
    return [KernelSpec(op="fused_moe", name="triton", fn=ops.fused_moe, priority=10,
                       is_available=triton_on_cuda()),
            KernelSpec(op="moe_router", name="triton", fn=ops.moe_router, priority=10,
                       is_available=triton_on_cuda())]
