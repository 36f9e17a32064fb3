"""Random routed-expert inputs for the parity tests and the benchmark, and the offline sm_90
compile of the one-launch slot kernel (registers, spills, SASS) for the CPU tests and for
whichever Triton is installed (3.6 on the H200's image, 3.7 in CI)."""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch


class MoeInputs(NamedTuple):
    """The arguments of ``fused_moe``, in order."""

    x: torch.Tensor             # [T, H]
    w13: torch.Tensor           # [E, 2I, H], gate rows then up rows
    w2: torch.Tensor            # [E, H, I]
    topk_weights: torch.Tensor  # [T, k + 1], x.dtype: the routed k sum to 1, then the shared
    topk_ids: torch.Tensor      # [T, k + 1] int64: k distinct routed experts, then E
    shared_w13: torch.Tensor    # [2I, H]: the shared expert, id E
    shared_w2: torch.Tensor     # [H, I]


def moe_inputs(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               seed: int = 0, skew: float = 0.0) -> MoeInputs:
    """``x ~ N(0, 1)`` and weights scaled by ``1 / sqrt(fan-in)``, so every stage stays O(1).
    Routing is what Qwen3.5's router gives: the renormalised top-k of ``softmax(logits)``, with
    ``logits ~ N(0, 1) - skew * expert index`` (a large ``skew`` sends every token to the same
    first experts: many blocks per expert, most experts idle), then the shared expert ``E``
    weighted ``sigmoid`` of an ``N(0, 1)`` gate logit."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    logits = torch.randn(tokens, num_experts, generator=gen, device=device)
    logits -= skew * torch.arange(num_experts, device=device)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    shared_weight = torch.randn(tokens, 1, generator=gen, device=device).sigmoid()
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return MoeInputs(
        x=randn(tokens, hidden),
        w13=randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=randn(num_experts, hidden, inter, scale=inter ** -0.5),
        topk_weights=torch.cat([weights, shared_weight], dim=1).to(dtype),
        topk_ids=torch.cat([ids, shared_id], dim=1),
        shared_w13=randn(2 * inter, hidden, scale=hidden ** -0.5),
        shared_w2=randn(hidden, inter, scale=inter ** -0.5),
    )


# ----------------------------------------------------------------------------- offline sm_90

RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def sm90_compiler_missing() -> str | None:
    """Why the installed Triton cannot compile and disassemble for sm_90 on this machine
    (``None`` when it can; checked under Triton 3.6 and 3.7); never under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter is on: nothing compiles"
    try:
        import triton
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
        from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401

        cuobjdump = knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError, RuntimeError) as error:
        return f"this Triton cannot compile for sm_90 offline: {error!r}"
    if not cuobjdump:
        return f"triton {triton.__version__} has no cuobjdump"
    return None


def compile_for_sm90(kernel, args: dict, options: dict):
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 with ``args``, every parameter
    by name (tensors, on ``meta`` or not, ints, constexpr values), specialized as a launch with
    those values would be (16-byte aligned pointers, integers divisible by 16 or equal to 1);
    ``options``: ``num_warps``, ``num_stages``."""
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


def compile_fused_slot(tokens: int, config, num_experts: int = 256, hidden: int = 2048,
                       inter: int = 512, top_k: int = 9, dtype: torch.dtype = torch.bfloat16):
    """The one-launch slot kernel (``triton_slot_fused``) compiled for sm_90 as it would be
    launched for ``tokens`` tokens at the given expert shape (Qwen3.5-35B-A3B's by default:
    top-8 plus the shared expert, 9 slots) with ``config`` (a ``FusedSlotConfig``)."""
    from qllm_kernels_moe.triton_slot_fused import _fused_slot_moe_kernel, fused_slot_args

    def meta(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    slots = tokens * top_k
    _, args = fused_slot_args(
        meta(tokens, hidden), meta(num_experts, 2 * inter, hidden),
        meta(num_experts, hidden, inter), meta(tokens, top_k),
        meta(tokens, top_k, dtype=torch.int64), meta(2 * inter, hidden), meta(hidden, inter),
        meta(slots, inter), meta(slots, hidden), meta(1024, dtype=torch.int32), config)
    return compile_for_sm90(_fused_slot_moe_kernel, args,
                            dict(num_warps=config.num_warps, num_stages=config.num_stages))


def sass_summary(compiled) -> dict:
    """Registers, spilled bytes (stack + local), shared memory, and the SASS opcode counts of
    a kernel compiled by ``compile_for_sm90``; ``sass`` the disassembly (opcodes, operands)
    in order."""
    cubin = compiled.asm["cubin"]
    registers, stack, _, local = map(int, RESOURCES.search(
        _cuobjdump(cubin, "--dump-resource-usage")).groups())
    sass = [(opcode, operands.strip()) for _, _, opcode, operands
            in SASS_LINE.findall(_cuobjdump(cubin, "-sass"))]
    return dict(registers=registers, spill_bytes=stack + local,
                shared=compiled.metadata.shared,
                opcodes=dict(collections.Counter(op.split(".")[0] for op, _ in sass)),
                sass=sass)


def fused_slot_prefetch(sass: list[tuple[str, str]]) -> tuple[int, int]:
    """In the one-launch slot kernel's SASS (``sass_summary(...)["sass"]``), the down task's
    plain global loads issued before its first poll of the ``ready`` counter (the first
    ``LDG.E.STRONG.SYS``, a volatile load) since the previous ``EXIT``, and those issued
    after it up to its output store (``STG``): the ``w2`` tile is meant to be all in the
    first count (prefetched while the slot's gate/up tasks finish), the second 0 (the
    ``hidden`` row is read through L2: ``LDG.E...STRONG.GPU``)."""
    polls = [i for i, (op, _) in enumerate(sass) if op.startswith("LDG") and "STRONG.SYS" in op]
    if not polls:
        raise ValueError("no volatile poll in this SASS")
    poll = polls[0]
    start = max([i for i, (op, _) in enumerate(sass[:poll]) if op == "EXIT"], default=-1)
    stores = [i for i, (op, _) in enumerate(sass) if i > poll and op.startswith("STG")]
    end = stores[0] if stores else len(sass)

    def plain_loads(part):
        return sum(op.startswith("LDG") and "STRONG" not in op for op, _ in part)

    return plain_loads(sass[start + 1:poll]), plain_loads(sass[poll:end])
