"""The sorted MoE path's grouped GEMM (``triton_moe._expert_gemm_8bit_kernel``) compiled for
sm_90 without a GPU (``qllm_kernels_int8.testing.compile_sorted_moe``), int8 and fp8, at the
op's config for each token count (``triton_moe.moe_config``: int8 its own table, fp8
kernels_moe's bf16 one, ``BLOCK_K`` fitted to the scale block by ``_fit``) and with its tiles
at other ``BLOCK_M`` values (``--block-m``, at 4 and 8 warps): one JSON line per (format,
tokens, GEMM, config), then one ``summary`` line.

Per case: the config, K steps per program, registers, spilled bytes, shared memory (and
whether it fits an SM's 227 KiB); the K loop's instruction count and opcodes; the MMA
instruction (``HMMA``: ``mma.sync`` on 16-row fragments, bf16 / fp16 operands; ``HGMMA``:
bf16 ``wgmma``; ``QGMMA``: fp8 ``wgmma``, e4m3 operands as stored), MMA instructions per
step, the operand conversions in the loop (``F2FP``: fp8 -> fp16 unpacks; ``PRMT`` /
``HADD2`` / ``I2F``: int8), the fp32 multiplies of fp8's per-step scales (``FMUL`` +
``FFMA``), the loop's register loads from global memory (``LDG``: the scales; the tiles
arrive by ``LDGSTS``) and spill traffic (``LDL`` / ``STL``), how many ``wgmma`` groups stay
in flight at its waits (0: each step's MMA retires before the next step issues; ``None``
without ``wgmma``); and the issue rates of ``testing.issue_rates`` per KiB of 8-bit weight.

What Triton 3.7.1 compiles (Qwen3.5-35B-A3B, 200 and 16,384 tokens):

- fp8 at ``BLOCK_M`` 16 and 32 (the bf16 table's 200-token entry: 16) runs no fp8 MMA:
  ``HMMA.16816.F32`` (fp16 ``mma.sync``) on tiles unpacked from e4m3 in registers, 3
  ``F2FP`` per ``HMMA`` (96 per step at the table's tiles). From ``BLOCK_M`` 64 (one
  warpgroup's rows) it runs ``QGMMA.64xNx32.F32.E4M3.E4M3``, no conversion. Per KiB of
  weight the table's 16-row fp8 loop issues about half of int8's (17-18 against 31-35
  instructions per scheduler).
- Every ``wgmma`` K loop, int8 and fp8, waits for 0 groups in flight: each step's MMAs
  retire before the next step's are issued. fp8's chain starts from zero each step and its
  result is scaled into the accumulator (``acc += dot * a_s * w_s``: 2 fp32 instructions
  per accumulator element per step), after per-step ``LDG``s of the scales.
- fp8 at 16,384 tokens (the bf16 table's 8-warp tiles, ``BLOCK_M`` 128): gate-up spills 536
  bytes at 255 registers (166 local loads / stores in its K loop of 688 instructions; int8's
  4-warp tiles: 334, no spill); at 4 warps 904 bytes; at ``BLOCK_M`` 64 136 bytes at 4
  warps, none at 8. Down does not spill at the table's tiles. At 200 tokens ``BLOCK_M`` 64
  fits in registers at 4 warps (252-253), 128 spills at 4 warps (416-448 bytes), not at 8.

    python plugins/kernels_int8/benchmarks/sass_moe.py [--tokens 200 16384] \
        [--formats int8 fp8] [--block-m 32 64 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import triton

from qllm_kernels_int8.testing import compile_sorted_moe, issue_rates, sass_summary
from qllm_kernels_int8.triton_moe import _fit, moe_config

EXPERTS, HIDDEN, INTER, SLOTS_PER_TOKEN = 256, 2048, 512, 9  # top-8 + the shared expert
FORMATS = {"int8": None, "fp8": (128, 128)}  # the weights' scale block
SMEM_BYTES = 227 * 1024  # shared memory one program may take on an H100 / H200
CONVERSIONS = ("F2FP", "I2F", "PRMT", "HADD2")
WARPS = (4, 8)


def variants(tokens: int, block: tuple[int, int] | None, block_ms: list[int]
             ) -> list[tuple[str, str, int, object]]:
    """``(source, GEMM, BLOCK_M, tiles)``: the op's config at ``tokens`` (``rule``), then its
    tiles at each of its ``BLOCK_M`` and ``block_ms`` and each of ``WARPS`` (``alt``)."""
    rule = moe_config(tokens, EXPERTS, 2 * INTER, HIDDEN, SLOTS_PER_TOKEN, block)
    found = []
    for gemm, tiles in (("gate_up", rule.up), ("down", rule.down)):
        found.append(("rule", gemm, rule.BLOCK_M, _fit(tiles, block)))
        found += [("alt", gemm, block_m, _fit(dataclasses.replace(tiles, num_warps=warps),
                                              block))
                  for block_m in sorted({rule.BLOCK_M, *block_ms}) for warps in WARPS
                  if (block_m, warps) != (rule.BLOCK_M, tiles.num_warps)]
    return found


def describe(fmt: str, tokens: int, source: str, gemm: str, block_m: int, tiles) -> dict:
    """One JSON line: the case, its config and the compiled K loop's summary."""
    gated = gemm == "gate_up"
    summary = sass_summary(compile_sorted_moe(tokens, gated, block_m, tiles, FORMATS[fmt],
                                              EXPERTS, HIDDEN, INTER, SLOTS_PER_TOKEN))
    opcodes = summary["loop_opcodes"]
    mma = summary["mma"]
    return dict(format=fmt, tokens=tokens, gemm=gemm, source=source,
                config=dict(BLOCK_M=block_m, **dataclasses.asdict(tiles)),
                steps=triton.cdiv(HIDDEN if gated else INTER, tiles.BLOCK_K),
                triton=triton.__version__, **summary,
                fits_smem=summary["shared"] <= SMEM_BYTES,
                mma_per_step=opcodes.get(mma.split(".")[0], 0) if mma else 0,
                conversions={op: opcodes[op] for op in CONVERSIONS if op in opcodes},
                scale_fp32_ops=opcodes.get("FMUL", 0) + opcodes.get("FFMA", 0),
                loop_ldg=opcodes.get("LDG", 0),
                loop_spill_ops=opcodes.get("LDL", 0) + opcodes.get("STL", 0),
                **issue_rates(summary, tiles.num_warps,
                              (2 if gated else 1) * tiles.BLOCK_N * tiles.BLOCK_K))


def summarize(lines: list[dict]) -> dict:
    """The findings across the cases: the MMA instructions per format and ``BLOCK_M``, the
    ``wgmma`` groups left in flight at the K loops' waits (all values seen), the cases that
    spill; then each case as one short string (``format tokens GEMM source BM/BN/BK warps
    stages: MMA, registers, spill bytes, loop instructions, wgmma groups in flight``)."""
    mma: dict[str, dict[int, list[str]]] = {}
    for line in lines:
        kinds = mma.setdefault(line["format"], {}).setdefault(line["config"]["BLOCK_M"], [])
        if line["mma"] not in kinds:
            kinds.append(line["mma"])
    cases = [f"{line['format']} {line['tokens']} {line['gemm']} {line['source']} "
             "{BLOCK_M}/{BLOCK_N}/{BLOCK_K} w{num_warps} s{num_stages}".format(**line["config"])
             for line in lines]
    return dict(
        summary=dict(
            mma=mma,
            wgmma_in_flight_at_waits=sorted({line["wgmma_in_flight"] for line in lines
                                             if line["wgmma_in_flight"] is not None}),
            spills={case: line["spill_bytes"] for case, line in zip(cases, lines)
                    if line["spill_bytes"]},
            cases=[f"{case}: {line['mma']}, {line['registers']} reg, {line['spill_bytes']} B "
                   f"spill, {line['loop_instructions']} loop, in flight "
                   f"{line['wgmma_in_flight']}" for case, line in zip(cases, lines)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[200, 16384])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--block-m", nargs="+", type=int, default=[32, 64, 128],
                        help="BLOCK_M values to try the op's tiles at, beside its own")
    args = parser.parse_args()
    lines = []
    for fmt in args.formats:
        for tokens in args.tokens:
            for case in variants(tokens, FORMATS[fmt], args.block_m):
                lines.append(describe(fmt, tokens, *case))
                print(json.dumps(lines[-1]), flush=True)
    print(json.dumps(summarize(lines)))


if __name__ == "__main__":
    main()
