"""Programmatic dependent launch (PDL) of the kernel plugins' Triton kernels, opt-in.

``QLLM_PDL=1`` in the environment (read once, at import: ``PDL``; unset, empty or ``0``: off)
launches the decode path's Triton kernels with ``launch_pdl=True`` on Hopper and later GPUs:
a kernel's programs may start while the previous kernel on the stream is still finishing (in a
CUDA graph, a programmatic edge), so the launch and ramp-up of each kernel hide behind the tail
of the one before.

Each such kernel takes a ``USE_PDL: tl.constexpr`` and, with it, on the path every thread runs,
first lets the next PDL-launched kernel launch (``gdc_launch_dependents``), then waits for the
previous kernel to complete and its writes to be visible (``gdc_wait``) before it reads
anything an earlier kernel wrote and before it stores anything: ``pdl_enter`` at kernel entry
does both. The wait must be unconditional in every PDL-launched kernel: a kernel's own wait is
what orders it after every kernel before its predecessor. Only parameters no kernel of the
step writes (model weights) may be read before it (the GEMV reads its first weight tile so).
Without ``USE_PDL`` the constexpr prunes it all and a kernel compiles to its code without PDL.

Launchers call ``pdl_arguments(device)`` (or ``use_pdl`` and ``launch_options``): PDL is on
where the switch is and ``pdl_available`` (never on the CPU nor under the Triton interpreter,
which runs no inline PTX). Kernels launched without PDL (Inductor's, cuBLAS) keep the stream's
full ordering: a PDL-launched kernel after one starts when it has completed, and one after a
PDL-launched kernel waits for all of it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "QLLM_PDL"


def pdl_switch(value: str | None) -> bool:
    """``QLLM_PDL``'s value as the switch: ``1`` on; unset, empty or ``0`` off."""
    if value not in (None, "", "0", "1"):
        raise ValueError(f"{PDL_ENV}={value!r}: 1 (programmatic dependent launch) or 0")
    return value == "1"


# Launch the decode path's kernels with programmatic dependent launch where the device allows.
PDL = pdl_switch(os.environ.get(PDL_ENV))
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_available(device: torch.device) -> bool:
    """Whether a kernel can be launched with PDL on ``device``: a CUDA device of compute
    capability 9.0 or later (``griddepcontrol``), Triton compiling rather than interpreting."""
    return (device.type == "cuda" and not _INTERPRETING and torch.cuda.is_available()
            and _hopper_or_later(device.index if device.index is not None
                                 else torch.cuda.current_device()))


def use_pdl(device: torch.device, pdl: bool | None = None) -> bool:
    """Whether to launch on ``device`` with PDL: ``pdl`` (default: the switch, ``PDL``) where
    ``pdl_available``."""
    return (PDL if pdl is None else pdl) and pdl_available(device)


def launch_options(pdl: bool) -> dict:
    """The launch options PDL adds: ``launch_pdl=True`` with it, none without (the launch of a
    kernel without PDL stays the one it always was)."""
    return dict(launch_pdl=True) if pdl else {}


def pdl_arguments(device: torch.device) -> dict:
    """The keyword arguments of a launch on ``device``: the kernel's ``USE_PDL`` and, with
    PDL, ``launch_pdl``."""
    pdl = use_pdl(device)
    return dict(USE_PDL=pdl, **launch_options(pdl))


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: let the next PDL-launched kernel launch, then wait until the previous
    kernel has completed and its writes are visible. Call it where every thread passes, before
    any load of an earlier kernel's output and any store; without ``USE_PDL``, nothing."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
