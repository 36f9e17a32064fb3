"""qllm plugin entry point: registers the Gated DeltaNet kernels through ``qllm_kernels``.

- ``triton`` (priority 10, above the plain-torch references' 0): ``causal_conv1d_prefill``,
  ``causal_conv1d_update``, ``gdn_decode``, ``gdn_prefill`` (token-by-token recurrence),
  ``rms_norm_gated`` (the layer's output norm) and ``gdn_decode_gated_norm`` (the decode
  recurrence and that norm, one kernel in small steps) on CUDA when Triton is importable.
- ``fla`` (priority 20, so it wins over the recurrent prefill): ``gdn_prefill`` through fla's
  chunked kernels, available only where ``fla-core`` is installed (``pip install
  qllm-kernels-gdn[fla]``).

No kernel here uses ``tl.dot`` on its inputs, so every float activation dtype is served.
"""

from __future__ import annotations

import importlib.util

import torch

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import FLOAT_DTYPES, KernelSpec, triton_on_cuda
from qllm_kernels_gdn import ops

HAS_FLA = importlib.util.find_spec("fla") is not None
# The Triton kernels take any float activation dtype.
triton_available = triton_on_cuda(FLOAT_DTYPES)


def fla_available(device: torch.device, dtype: torch.dtype) -> bool:
    """fla's kernels need the same, and ``fla-core``."""
    return HAS_FLA and triton_available(device, dtype)


@hookimpl
def qllm_kernels():
    def triton(op, fn):
        return KernelSpec(op=op, name="triton", fn=fn, priority=10,
                          is_available=triton_available)

    return [
        triton("causal_conv1d_prefill", ops.causal_conv1d_prefill),
        triton("causal_conv1d_update", ops.causal_conv1d_update),
        triton("gdn_decode", ops.gdn_decode),
        triton("gdn_decode_gated_norm", ops.gdn_decode_gated_norm),
        triton("gdn_prefill", ops.gdn_prefill),
        triton("rms_norm_gated", ops.rms_norm_gated),
        KernelSpec(op="gdn_prefill", name="fla", fn=ops.fla_gdn_prefill, priority=20,
                   is_available=fla_available),
    ]
