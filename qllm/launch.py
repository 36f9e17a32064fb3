"""Launch settings shared by the kernel plugins' Triton kernels: programmatic dependent launch.

With programmatic dependent launch (PDL, Hopper and newer) a kernel may start while the kernel
before it in the stream is still running: once every program of that kernel has executed
``tl.extra.cuda.gdc_launch_dependents()``, or ended. The early kernel's programs then do what
does not depend on the kernel before (load weights, which no kernel writes) and block in
``tl.extra.cuda.gdc_wait()`` until that kernel has ended and its writes are visible. In a
decode step of hundreds of short kernels this overlaps each kernel's start with the tail of
the one before.

The rules every qllm kernel launched with PDL follows:

- it calls ``gdc_wait()`` before it writes anything, and before it reads anything a kernel
  may have written, with one exception below: before its wait it reads only weights;
- it calls ``gdc_launch_dependents()`` only after its ``gdc_wait()``. So when a kernel starts,
  everything launched before the kernel just before it has ended. The exception: inside one
  op whose kernels run in a fixed order, a kernel that always follows another of the op's
  kernels may read, before its wait, what was written before that kernel and that kernel
  does not write (the op's inputs, its earlier kernels' outputs). The MoE's second GEMM reads
  the align's block lists that way, the small-batch path's down GEMV the expert ids. A kernel
  that may follow itself on the same buffers (the GDN recurrence on its state) waits first.

``wait_for_predecessor(USE_PDL)`` does both, in that order, inside a kernel.
"""

from __future__ import annotations

import functools
import os

import torch

from qllm.specs import HAS_TRITON

# "1" turns PDL on. Off by default until it has been measured and its tests have passed on
# the H200: a wait in the wrong place would be a silent data race.
PDL_ENV = "QLLM_PDL"


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def use_pdl(device: torch.device) -> bool:
    """Whether qllm's Triton kernels on ``device`` launch with PDL: a CUDA device of compute
    capability 9.0 or newer, when ``QLLM_PDL=1``. Kernels take it through ``pdl_options``."""
    if device.type != "cuda" or os.environ.get(PDL_ENV) != "1":
        return False
    return _supports_pdl(device.index if device.index is not None
                         else torch.cuda.current_device())


def pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a qllm Triton kernel on ``device``: its ``USE_PDL`` constexpr
    (``wait_for_predecessor``) and Triton's ``launch_pdl`` attribute, always equal
    (``use_pdl``)."""
    enabled = use_pdl(device)
    return {"USE_PDL": enabled, "launch_pdl": enabled}


if HAS_TRITON:  # for the plugins' Triton kernels
    import triton
    import triton.language as tl

    @triton.jit
    def wait_for_predecessor(USE_PDL: tl.constexpr):
        """In a kernel launched with PDL: wait until the kernel before it in the stream has
        ended and its writes are visible, then let the kernel after it launch. Nothing
        without ``USE_PDL``."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
