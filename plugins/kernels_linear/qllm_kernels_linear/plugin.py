"""qllm plugin entry point: registers the Triton GEMV for the ``linear`` op through
``qllm_kernels``.

``triton`` (priority 10, above the plain-torch reference's 0) serves ``linear`` on CUDA in
fp16/bf16 when Triton is importable; the op itself hands calls of more than a few rows to
``F.linear``.
"""

from __future__ import annotations

import importlib.util

import torch

from qllm.hookspecs import hookimpl
from qllm.specs import KernelSpec
from qllm_kernels_linear import ops

HALF_DTYPES = (torch.float16, torch.bfloat16)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def cuda_half_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel needs CUDA, fp16/bf16 activations and Triton."""
    return HAS_TRITON and device.type == "cuda" and dtype in HALF_DTYPES


@hookimpl
def qllm_kernels():
    return [KernelSpec(op="linear", name="triton", fn=ops.linear, priority=10,
                       is_available=cuda_half_available)]
