"""qllm plugin entry point: registers the Triton GEMV for the ``linear`` op, the residual
add + RMSNorm for ``add_rms_norm`` and the two fused for ``add_rms_norm_linear`` through
``qllm_kernels``.

``triton`` (priority 10, above the plain-torch references' 0) serves ``linear`` and
``add_rms_norm_linear`` on CUDA in fp16/bf16 when Triton is importable; the ops themselves hand
calls of more than a few rows to ``F.linear`` (after ``add_rms_norm``). ``add_rms_norm`` is
served on CUDA in every float dtype.
"""

from __future__ import annotations

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import FLOAT_DTYPES, KernelSpec, triton_on_cuda
from qllm_kernels_linear import ops


@hookimpl
def qllm_kernels():
    return [KernelSpec(op="linear", name="triton", fn=ops.linear, priority=10,
                       is_available=triton_on_cuda()),
            KernelSpec(op="add_rms_norm", name="triton", fn=ops.add_rms_norm, priority=10,
                       is_available=triton_on_cuda(FLOAT_DTYPES)),
            KernelSpec(op="add_rms_norm_linear", name="triton", fn=ops.add_rms_norm_linear,
                       priority=10, is_available=triton_on_cuda())]
