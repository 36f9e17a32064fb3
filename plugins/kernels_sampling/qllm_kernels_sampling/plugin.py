"""qllm plugin entry point: registers the Triton ``sample_tokens`` kernel through
``qllm_kernels`` (priority 10, above the plain-torch reference's 0) on CUDA in every float
dtype when Triton is importable. The kernel module is imported on the first call, so the
plugin loads without Triton."""

from __future__ import annotations

import torch

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import FLOAT_DTYPES, KernelSpec, triton_on_cuda


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """The ``sample_tokens`` op on the Triton kernel (``triton_sample``)."""
    from qllm_kernels_sampling.triton_sample import sample_tokens as launch

    return launch(logits, temperature, seed)


@hookimpl
def qllm_kernels():
    return [KernelSpec(op="sample_tokens", name="triton", fn=sample_tokens, priority=10,
                       is_available=triton_on_cuda(FLOAT_DTYPES))]
