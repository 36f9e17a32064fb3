"""Random routed-expert inputs for the parity tests and the benchmark, and the offline sm_90
compile of the one-launch slot kernel (registers, spills, SASS) for the CPU tests and for
whichever Triton is installed (3.6 on the H200's image, 3.7 in CI)."""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from qllm.testing.sm90 import compile_for_sm90, resource_usage, sass_instructions


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
    sass = [(opcode, operands) for _, opcode, operands in sass_instructions(compiled)]
    return dict(**resource_usage(compiled),
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
