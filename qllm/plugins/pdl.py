"""Programmatic dependent launch (PDL) of the kernel plugins' Triton kernels in small decode
steps.

The decode path's Triton kernels launch with ``launch_pdl=True`` on Hopper and later GPUs when
they serve at most ``PDL_MAX_ROWS`` rows (tokens or sequences): a kernel's programs may start
while the previous kernel on the stream is still finishing (in a CUDA graph, a programmatic
edge), so the launch and ramp-up of each kernel hide behind the tail of the one before. That
pays where kernels are short: W3 (one sequence) decoded at 385.7 against 368.6 tok/s in bf16
and 454.8 against 386.9 with int8 weights. In large steps it does not: at W2's 200 sequences
the GDN recurrence (102,400 one-warp programs, each waiting at entry) took 124.6 us against
107.2 and W2 lost 2% (7,671 against 7,824 tok/s), W1's 256-sequence step 1.5% (all on one
H200, 2026-12-03). ``QLLM_PDL=0`` in the environment (read once, at import: ``PDL``) turns it
off everywhere; unset, empty or ``1``: on (``qllm.switches``: other values are refused).

Each such kernel takes a ``USE_PDL: tl.constexpr`` and, with it, on the path every thread runs,
first lets the next PDL-launched kernel launch (``gdc_launch_dependents``), then waits for the
previous kernel to complete and its writes to be visible (``gdc_wait``) before it reads
anything an earlier kernel wrote and before it stores anything: ``pdl_enter`` at kernel entry
does both. The wait must be unconditional in every PDL-launched kernel: a kernel's own wait is
what orders it after every kernel before its predecessor. Before it a kernel may read only
what no kernel of the step before it writes (then split ``pdl_enter`` into ``pdl_release``,
those reads, ``pdl_wait``): model weights (the GEMV reads its first weight tile so), the step's
metadata (slots, positions: written by the host, or by kernels launched without PDL, before the
step's first PDL-launched kernel, which starts only once they have completed), and in a decode
step the recurrent state of the kernel's own layer, which only that kernel writes (the GDN
decode kernels read their slots' state so). Not the output of any kernel of the step before it:
each PDL-launched kernel lets the next one launch at its entry, so a kernel may start while
several before it still run. The exception: a kernel that lets the next one launch only after
its own wait (``pdl_wait`` then ``pdl_release``) starts it once every kernel before it has
completed (a dependent launches when all the programs before it have released or exited), so
the next kernel may read those kernels' outputs before its wait (not its direct
predecessor's), past the L1 cache (``cache_modifier=".cg"``): the slot MoE's gate-up and down
(``qllm_kernels_moe.triton_slot_moe``). Without ``USE_PDL`` the constexpr prunes it all and a
kernel compiles to its code without PDL.

Launchers call ``pdl_arguments(device, rows)`` (or ``use_pdl`` and ``launch_options``): PDL is
on where the switch is, the rows are few enough and ``pdl_available`` (never on the CPU nor
under the Triton interpreter, which runs no inline PTX). Kernels launched without PDL
(Inductor's, cuBLAS) keep the stream's full ordering: a PDL-launched kernel after one starts
when it has completed, and one after a PDL-launched kernel waits for all of it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qllm.switches import env_switch

PDL_ENV = "QLLM_PDL"


# Launch the decode path's kernels with programmatic dependent launch where the device allows.
PDL = env_switch(PDL_ENV)
# ... in launches of at most this many rows (tokens or sequences): the latency-bound steps
PDL_MAX_ROWS = 16
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


def use_pdl(device: torch.device, rows: int, pdl: bool | None = None) -> bool:
    """Whether to launch a kernel serving ``rows`` rows (tokens or sequences) on ``device``
    with PDL: ``pdl`` (default: the switch, ``PDL``, for at most ``PDL_MAX_ROWS`` rows) where
    ``pdl_available``."""
    wanted = PDL and rows <= PDL_MAX_ROWS if pdl is None else pdl
    return wanted and pdl_available(device)


def launch_options(pdl: bool) -> dict:
    """The launch options PDL adds: ``launch_pdl=True`` with it, none without (the launch of a
    kernel without PDL stays the one it always was)."""
    return dict(launch_pdl=True) if pdl else {}


def pdl_arguments(device: torch.device, rows: int) -> dict:
    """The keyword arguments of a launch serving ``rows`` rows on ``device``: the kernel's
    ``USE_PDL`` and, with PDL (``use_pdl``), ``launch_pdl``."""
    pdl = use_pdl(device, rows)
    return dict(USE_PDL=pdl, **launch_options(pdl))


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: let the next PDL-launched kernel launch, then wait until the previous
    kernel has completed and its writes are visible. Call it where every thread passes, before
    any load of an earlier kernel's output and any store; without ``USE_PDL``, nothing."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """``pdl_enter``'s first half, at kernel entry: with ``USE_PDL``, let the next PDL-launched
    kernel launch."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """``pdl_enter``'s second half: with ``USE_PDL``, wait until the previous kernel has
    completed and its writes are visible. Every thread must pass it, before any load of an
    earlier kernel's output and any store (module docstring: what may be read before it)."""
    if USE_PDL:
        gdc_wait()
