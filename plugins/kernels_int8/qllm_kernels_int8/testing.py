"""The W8A16 GEMMs and the sorted MoE's grouped GEMM compiled for sm_90 without a GPU,
specialized as a real launch would be, and a summary of their code (registers, shared memory,
the K loop's instructions, writes into the registers of an MMA in flight): what backs the
kernels' design in the tests and in ``benchmarks/sass_w8a16.py`` / ``sass_moe.py``, for
whichever Triton is installed (its code differs between versions: see ``triton_w8a16``),
through ``qllm.testing.sm90``.
"""

from __future__ import annotations

import collections
import re

import torch

from qllm.testing.sm90 import compile_for_sm90, resource_usage, sass_instructions
from qllm_kernels_int8.gemm_configs import W8A16GemmConfig, swap_ab_config
from qllm_kernels_moe.configs import GemmConfig


def k_loop(found: list[tuple[int, str, str]]) -> list[tuple[str, str]]:
    """``(opcode, operands)`` of each instruction of the longest loop holding an MMA (the K
    loop) among ``found`` (``sass_instructions``): from a backward branch's target to the
    branch."""
    best: list[tuple[str, str]] = []
    for address, opcode, operands in found:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [(op, rest) for at, op, rest in found
                    if int(target.group(1), 16) <= at <= address]
            if len(body) > len(best) and any("MMA" in op.split(".")[0] for op, _ in body):
                best = body
    return best


REGISTER = re.compile(r"^R(\d+)$")
A_REGISTERS_PER_MMA = 4  # 32-bit registers of a 64 x 16 fp16 / bf16 A fragment per thread


def _register_writes(opcode: str, operands: str) -> set[int]:
    """The general registers an instruction writes: its first operand's (the second's for
    ``SHFL``, whose first is a predicate), 2 for ``.64`` / ``.WIDE`` results, 4 for ``.128``;
    none for stores (their first operand is an address), branches, barriers and the MMA (whose
    accumulator may be chained without a wait)."""
    parts = [part.strip() for part in operands.split(",")]
    base = opcode.split(".")[0]
    if base in ("HGMMA", "WARPGROUP"):
        return set()
    first = parts[1] if base == "SHFL" and len(parts) > 1 else parts[0]
    match = REGISTER.match(first)
    if not match:
        return set()
    width = 4 if ".128" in opcode else 2 if ".64" in opcode or ".WIDE" in opcode else 1
    return set(range(int(match.group(1)), int(match.group(1)) + width))


def in_flight_a_writes(loop: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The K loop's instructions that write a register holding the A operand of a ``wgmma``
    that may still be in flight there: each ``HGMMA ... R<a>`` reads ``R<a>``..``R<a+3>`` until
    a ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves its group out of the N newest (groups end at
    ``gsb0``), followed over a second pass of the loop (what the previous step left in flight).
    PTX makes such a write undefined, and ptxas 12.8 (the one Triton 3.6 and 3.7 bundle) does
    not keep the A registers from the next step's values while the MMA is in flight."""
    pending: list[set[int]] = []
    current: set[int] = set()
    found = []
    for lap in range(2):
        for opcode, operands in loop:
            if opcode.split(".")[0] == "HGMMA":
                match = REGISTER.match(operands.split(",")[1].strip())
                if match:
                    first = int(match.group(1))
                    current |= set(range(first, first + A_REGISTERS_PER_MMA))
                if "gsb0" in operands:
                    pending.append(current)
                    current = set()
            elif opcode == "WARPGROUP.DEPBAR.LE":
                keep = int(re.search(r"gsb0, 0x([0-9a-f]+)", operands).group(1), 16)
                pending = pending[max(0, len(pending) - keep):] if keep else []
            if lap and _register_writes(opcode, operands) & set().union(current, *pending):
                found.append((opcode, operands.strip()))
    return found


def sass_summary(compiled) -> dict:
    """Registers, stack (spills), shared memory, and the K loop: its instruction count, opcode
    counts, MMA instruction, whether the ``wgmma`` reads A from registers, how many MMA
    groups it leaves in flight at its waits (``None`` without ``wgmma``), and how many of its
    instructions write the A registers of an MMA that may be in flight (``in_flight_a_writes``;
    anything but 0 is a race)."""
    loop = k_loop(sass_instructions(compiled))
    opcodes = collections.Counter(op.split(".")[0] for op, _ in loop)
    mma = [(op, operands) for op, operands in loop if "MMA" in op.split(".")[0]]
    waits = [int(m.group(1), 16) for op, operands in loop if op == "WARPGROUP.DEPBAR.LE"
             for m in [re.search(r"gsb0, 0x([0-9a-f]+)", operands)] if m]
    return dict(**resource_usage(compiled), loop_instructions=len(loop), loop_opcodes=dict(opcodes),
                mma=mma[0][0] if mma else None,
                mma_a_in_registers=bool(mma) and mma[0][1].split(",")[1].strip().startswith("R"),
                wgmma_in_flight=min(waits) if waits else None,
                a_written_in_flight=len(in_flight_a_writes(loop)))


SCHEDULERS = 4  # warp schedulers per SM


def issue_rates(summary: dict, warps: int, weight_bytes_per_step: int) -> dict:
    """``issue_per_step``: the K loop's warp instructions per SM scheduler per step, and
    ``issue_per_weight_kb``: the same per KiB of weight the step reads, a floor on the issue
    cycles a program spends per KiB of weight (before any wait)."""
    issue = summary["loop_instructions"] * warps / SCHEDULERS
    return dict(issue_per_step=round(issue),
                issue_per_weight_kb=round(issue * 1024 / weight_bytes_per_step, 1))


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


def compile_sorted_moe(tokens: int, gated: bool, block_m: int, tiles: GemmConfig,
                       block: tuple[int, int] | None = None, experts: int = 256,
                       hidden: int = 2048, inter: int = 512, slots_per_token: int = 9):
    """One grouped GEMM of the sorted MoE path (``triton_moe._expert_gemm_8bit_kernel``)
    compiled for sm_90 as ``fused_moe_8bit`` launches it at ``tokens`` tokens: gate-up
    (``gated``: ``x [T, hidden]`` -> ``[S, inter]``) or down (``[S, inter]`` -> ``[S,
    hidden]``), int8 (``block`` ``None``) or fp8 with ``block`` scales, on the sort at
    ``block_m`` slots per block, at ``tiles`` (``BLOCK_K`` as given: ``triton_moe._fit``
    is the caller's). Defaults: Qwen3.5-35B-A3B's experts, top-8 plus the shared one."""
    from qllm_kernels_int8.quant import FP8_DTYPE
    from qllm_kernels_int8.triton_moe import _expert_gemm_8bit_kernel, expert_gemm_args
    from qllm_kernels_moe.align import SortedSlots, max_padded_slots

    slots = tokens * slots_per_token
    rows, k, width = (2 * inter, hidden, inter) if gated else (hidden, inter, hidden)
    a_rows = tokens if gated else slots
    padded = max_padded_slots(slots, experts + 1, block_m)
    sort = SortedSlots(_meta(padded, dtype=torch.int64), _meta(padded // block_m,
                                                             dtype=torch.int64),
                       _meta(1, dtype=torch.int64))
    out = _meta(slots, width, dtype=torch.bfloat16)
    routing = out if gated else _meta(tokens, slots_per_token, dtype=torch.bfloat16)
    if block is None:
        a = a_scale = _meta(a_rows, k, dtype=torch.bfloat16)  # no activation scales
        w, shared_w = (_meta(*shape, rows, k, dtype=torch.int8) for shape in ((experts,), ()))
        w_scale, shared_scale = _meta(experts, rows, dtype=torch.float32), _meta(
            rows, dtype=torch.float32)
    else:
        groups, row_blocks = -(-k // block[1]), -(-rows // block[0])
        a, a_scale = _meta(a_rows, k, dtype=FP8_DTYPE), _meta(a_rows, groups,
                                                              dtype=torch.float32)
        w, shared_w = (_meta(*shape, rows, k, dtype=FP8_DTYPE) for shape in ((experts,), ()))
        w_scale = _meta(experts, row_blocks, groups, dtype=torch.float32)
        shared_scale = _meta(row_blocks, groups, dtype=torch.float32)
    args = expert_gemm_args(a, a_scale, w, w_scale, shared_w, shared_scale, out, routing, sort,
                            block_m, tiles, slots_per_a_row=slots_per_token if gated else 1,
                            gated=gated, block=block)
    return compile_for_sm90(_expert_gemm_8bit_kernel, args,
                            dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
