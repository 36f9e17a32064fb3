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


# Thread blocks one multiprocessor holds at most: 32 on compute capability 8.0, 9.0 and 10.x,
# 16 on the others since 7.5 (and taken as 16 wherever not known: fewer is safe)
WIDE_BLOCK_LIMIT = {(8, 0), (9, 0), (10, 0), (10, 3)}
REGISTER_ALLOCATION_UNIT = 256  # registers are allocated to a warp in units of this many


def resident_programs_per_sm(compiled, device: torch.device) -> int:
    """How many programs of ``compiled`` (a Triton ``CompiledKernel``) one multiprocessor of
    the CUDA ``device`` holds at once, bounded by its threads, registers and shared memory: a
    persistent kernel whose programs wait for each other must not launch more."""
    compiled._init_handles()  # loads the binary: its register count
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    warp_registers = -(-compiled.n_regs * props.warp_size // REGISTER_ALLOCATION_UNIT) \
        * REGISTER_ALLOCATION_UNIT
    bounds = [32 if (props.major, props.minor) in WIDE_BLOCK_LIMIT else 16,
              props.max_threads_per_multi_processor // (props.warp_size * warps),
              props.regs_per_multiprocessor // warp_registers // warps]
    if compiled.metadata.shared:  # each block also holds 1 KiB the driver reserves
        bounds.append(props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024))
    return min(bounds)
