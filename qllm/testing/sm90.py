"""Triton kernels compiled for sm_90 (Hopper) on a machine without a GPU, specialized as a real
launch would be, and what their code says: registers, spills, shared memory, the SASS.

The kernel plugins' tests and benchmarks check their kernels' compiled code with these, under
whichever Triton is installed (3.6 on the H200's image, 3.7 in CI: the two compile the same
kernel differently). ``qllm.testing.triton_launches`` compiles the interpreter tests' launches
from their argument types alone; a launch on a GPU also specializes pointers (16-byte aligned),
integers divisible by 16 and integers equal to 1, which decides the loads' vector widths.
``compile_for_sm90`` applies Triton's own specialization to the argument values (tensors on the
``meta`` device are enough); ``captured_launches`` gives the launches an op's launcher makes,
with those values, without running them.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple
from unittest import mock

import torch

# one SASS instruction of ``cuobjdump -sass``: address, predicate, opcode, operands
SASS_INSTRUCTION = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def sm90_compiler_missing() -> str | None:
    """Why the installed Triton cannot compile and disassemble for sm_90 here (``None`` when it
    can; checked under Triton 3.6 and 3.7); never under the interpreter
    (``TRITON_INTERPRET=1``: ``triton.jit`` functions do not compile)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter is on: nothing compiles"
    try:
        import triton
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
        from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401

        cuobjdump_path = knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"this Triton cannot compile for sm_90 offline: {error!r}"
    if not cuobjdump_path:
        return f"triton {triton.__version__} has no cuobjdump"
    return None


def specialize(kernel, args: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of ``kernel`` (a ``triton.jit`` function) launched
    with ``args``, every parameter by name (tensors, on ``meta`` or not, ints, ``None``,
    constexpr values), as Triton specializes a launch: what it compiles, and keys its compiles
    by."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    parameters = inspect.signature(kernel.fn).parameters
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = args[name]
        if "constexpr" in str(parameters[name].annotation):
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        specialized = index not in kernel.do_not_specialize
        kind, spec = native_specialize_impl(BaseBackend, value, False, specialized, specialized)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = spec
        elif spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_for_sm90(kernel, args: dict, options: dict):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 with ``args`` (every parameter
    by name), specialized as a launch with those values would be (``specialize``);
    ``options``: ``num_warps``, ``num_stages``..."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, *specialize(kernel, args)),
                          target=GPUTarget("cuda", 90, 32), options=options)


def on_meta(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the ``meta`` device, each with its shape, strides and dtype: what a launch
    specializes on, without data."""
    return tuple(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                     device="meta") for tensor in tensors)


class KernelLaunch(NamedTuple):
    """One Triton kernel launch: the ``triton.jit`` function, every parameter by name, and the
    launch options (``num_warps``, ``launch_pdl``...): ``compile_for_sm90``'s arguments."""

    kernel: Any
    args: dict
    options: dict


def captured_launches(call: Callable[[], object]) -> list[KernelLaunch]:
    """The Triton kernel launches ``call()`` makes, in order, captured instead of run: an op's
    launcher called on ``meta`` tensors gives its kernels as it would launch them."""
    from triton.runtime.jit import JITFunction

    launches = []

    def capture(kernel, *args, grid, warmup, **kwargs):
        options = {name: value for name, value in kwargs.items() if name not in kernel.arg_names}
        bound = inspect.signature(kernel.fn).bind(
            *args, **{name: value for name, value in kwargs.items() if name not in options})
        bound.apply_defaults()
        launches.append(KernelLaunch(kernel, dict(bound.arguments), options))

    with mock.patch.object(JITFunction, "run", capture):
        call()
    return launches


def cuobjdump(cubin: bytes, *flags: str) -> str:
    """What Triton's bundled ``cuobjdump`` prints for ``cubin`` with ``flags``."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, *flags, str(path)],
                              capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> dict:
    """Registers per thread, spilled bytes (stack + local) and shared memory of a kernel
    compiled by ``compile_for_sm90``."""
    dump = cuobjdump(compiled.asm["cubin"], "--dump-resource-usage")
    registers, stack, _, local = map(int, RESOURCES.search(dump).groups())
    return dict(registers=registers, spill_bytes=stack + local,
                shared=compiled.metadata.shared)


def sass_instructions(compiled) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of each SASS instruction of a kernel compiled by
    ``compile_for_sm90``, in order (operands stripped)."""
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    return [(int(address, 16), opcode, operands.strip())
            for address, _, opcode, operands in SASS_INSTRUCTION.findall(sass)]
