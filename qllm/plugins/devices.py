"""What the kernel plugins' launchers ask of a device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def multiprocessors(device: torch.device, elsewhere: int = 4) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``elsewhere`` (the Triton interpreter on
    the CPU), a small count by default, so CPU runs still spread work over several programs."""
    if device.type != "cuda":
        return elsewhere
    return torch.cuda.get_device_properties(device).multi_processor_count
