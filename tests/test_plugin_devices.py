"""qllm.plugins.devices: what the kernel plugins' launchers ask of a device, here the resident
programs a persistent kernel may launch, from a compiled kernel's resources and an sm_90
device's limits (both stand-ins: no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qllm.plugins import devices

# an H100's per-multiprocessor limits, as torch.cuda.get_device_properties gives them
H100 = SimpleNamespace(major=9, minor=0, warp_size=32, max_threads_per_multi_processor=2048,
                       regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472)
# an RTX 3090's (compute capability 8.6): 1,536 threads and 16 blocks
RTX_3090 = SimpleNamespace(major=8, minor=6, warp_size=32, max_threads_per_multi_processor=1536,
                           regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=102400)


class Compiled:
    """A stand-in for a Triton ``CompiledKernel``: its registers (known after
    ``_init_handles``), warps and shared memory."""

    def __init__(self, registers: int, warps: int, shared: int):
        self.metadata = SimpleNamespace(num_warps=warps, shared=shared)
        self._registers = registers

    def _init_handles(self):
        self.n_regs = self._registers


@pytest.mark.parametrize("registers,warps,shared,expected", [
    (62, 4, 1024, 8),  # the persistent slot MoE's one-token tiles: 64 a thread, all registers
    (64, 4, 0, 8),
    (65, 4, 0, 7),  # 72 a thread allocated: 7 of 4 warps
    (142, 4, 1024, 3),
    (32, 4, 0, 16),  # threads bound: 64 warps
    (16, 1, 0, 32),  # blocks bound
    (32, 4, 100_000, 2),  # shared memory bound (each block also holds 1 KiB)
])
def test_resident_programs_per_sm(monkeypatch, registers, warps, shared, expected):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    compiled = Compiled(registers, warps, shared)
    assert devices.resident_programs_per_sm(compiled, torch.device("cuda")) == expected


@pytest.mark.parametrize("registers,warps,expected", [
    (16, 1, 16),  # blocks bound: 16 on compute capability 8.6, not 32
    (32, 4, 12),  # threads bound: 48 warps
])
def test_resident_programs_per_sm_on_a_consumer_gpu(monkeypatch, registers, warps, expected):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: RTX_3090)
    compiled = Compiled(registers, warps, 0)
    assert devices.resident_programs_per_sm(compiled, torch.device("cuda")) == expected
