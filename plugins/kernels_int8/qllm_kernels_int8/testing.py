"""The W8A16 GEMMs compiled for sm_90 without a GPU, specialized as a real launch would be, and a
summary of their code (registers, shared memory, the K loop's instructions): what backs the
kernels' design in the tests and in ``benchmarks/sass_w8a16.py``.

``qllm.testing.triton_launches`` compiles the interpreter tests' launches from their argument
types alone; a launch on a GPU also specializes pointers (16-byte aligned), integers divisible
by 16 and integers equal to 1, which decides the loads' vector widths. ``compile_for_sm90``
applies Triton's own specialization to the argument values (tensors on the ``meta`` device
are enough).
"""

from __future__ import annotations

import collections
import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from qllm_kernels_int8.gemm_configs import W8A16GemmConfig, swap_ab_config

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_for_sm90(kernel, args: dict, options: dict):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 with ``args``, every parameter
    by name (tensors, ints, ``None``, constexpr values), specialized as a launch with those
    values would be; ``options``: ``num_warps``, ``num_stages``..."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    parameters = inspect.signature(kernel.fn).parameters
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = args[name]
        if "constexpr" in str(parameters[name].annotation):
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        specialize = index not in kernel.do_not_specialize
        kind, spec = native_specialize_impl(BaseBackend, value, False, specialize, specialize)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, str(path)],
                              capture_output=True, text=True, check=True).stdout


def k_loop(sass: str) -> list[tuple[str, str]]:
    """``(opcode, operands)`` of each instruction of the longest loop holding an MMA (the K
    loop): from a backward branch's target to the branch."""
    found = [(int(address, 16), opcode, operands)
             for address, _, opcode, operands in INSTRUCTION.findall(sass)]
    best: list[tuple[str, str]] = []
    for address, opcode, operands in found:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [(op, rest) for at, op, rest in found
                    if int(target.group(1), 16) <= at <= address]
            if len(body) > len(best) and any("MMA" in op.split(".")[0] for op, _ in body):
                best = body
    return best


def sass_summary(compiled) -> dict:
    """Registers, stack (spills), shared memory, and the K loop: its instruction count, opcode
    counts, MMA instruction, whether the ``wgmma`` reads A from registers, and how many MMA
    groups it leaves in flight at its waits (``None`` without ``wgmma``)."""
    cubin = compiled.asm["cubin"]
    registers, stack, _, local = map(int, RESOURCES.search(
        _cuobjdump(cubin, "--dump-resource-usage")).groups())
    loop = k_loop(_cuobjdump(cubin, "-sass"))
    opcodes = collections.Counter(op.split(".")[0] for op, _ in loop)
    mma = [(op, operands) for op, operands in loop if "MMA" in op.split(".")[0]]
    waits = [int(m.group(1), 16) for op, operands in loop if op == "WARPGROUP.DEPBAR.LE"
             for m in [re.search(r"gsb0, 0x([0-9a-f]+)", operands)] if m]
    return dict(registers=registers, spill_bytes=stack + local, shared=compiled.metadata.shared,
                loop_instructions=len(loop), loop_opcodes=dict(opcodes),
                mma=mma[0][0] if mma else None,
                mma_a_in_registers=bool(mma) and mma[0][1].split(",")[1].strip().startswith("R"),
                wgmma_in_flight=min(waits) if waits else None)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def compile_swap_ab(m: int, n: int, k: int, config: W8A16GemmConfig | None = None,
                    fast_int8: bool = True):
    """The swap-AB GEMM's kernel for ``x [m, k]`` bf16 through ``weight [n, k]``, compiled for
    sm_90 at ``config`` (the rule's by default), with the inline-PTX int8 conversion or
    Triton's cast."""
    from qllm_kernels_int8.triton_w8a16 import _swap_ab_kernel, swap_ab_args

    config = config or swap_ab_config(m, n, k)
    target = (_meta(m, n, dtype=torch.bfloat16) if config.SPLIT_K == 1
              else _meta(config.SPLIT_K, m, n, dtype=torch.float32))
    args = swap_ab_args(_meta(m, k, dtype=torch.bfloat16), _meta(n, k, dtype=torch.int8),
                        _meta(n, dtype=torch.float32), None, target, config, fast_int8)
    return compile_for_sm90(_swap_ab_kernel, args, dict(num_warps=config.num_warps,
                                                        num_stages=config.num_stages))


def compile_shared_b(m: int, n: int, k: int):
    """The shared-B GEMM's kernel (``triton_linear``, int8) for ``x [m, k]`` bf16 through
    ``weight [n, k]``, compiled for sm_90 at its rule's config."""
    from qllm_kernels_int8.triton_linear import _gemm_8bit_kernel, gemm_8bit_args, gemm_config

    config = gemm_config(m, n, k)
    scale = _meta(n, dtype=torch.float32)
    args = gemm_8bit_args(_meta(m, k, dtype=torch.bfloat16), scale, _meta(n, k, dtype=torch.int8),
                          scale, None, _meta(m, n, dtype=torch.bfloat16), False, 1, 1, config)
    return compile_for_sm90(_gemm_8bit_kernel, args, dict(num_warps=config[4],
                                                          num_stages=config[5]))
