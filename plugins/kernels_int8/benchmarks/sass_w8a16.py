"""The two W8A16 GEMMs' compiled code side by side, without a GPU: each one's rule config at the
Qwen3.5-35B-A3B projection shapes, compiled for sm_90 as its launch would be
(``qllm_kernels_int8.testing``), one JSON line per (rows, shape, kernel).

Per kernel: the config, the grid (``programs``) and loop steps per program; registers, spilled
bytes, shared memory; the K loop's instruction count and opcodes; the MMA instruction, whether
its A operand is in registers, how many MMA groups stay in flight at its waits and how many
loop instructions write the A registers of an MMA in flight (a race unless 0); the Triton that
compiled it (the installed one: its code differs between versions). Derived:
``issue_per_step``, the loop's warp instructions per SM scheduler per step (4 schedulers), and
``issue_per_weight_kb`` the same per KiB of int8 weight the step reads, a floor on the issue
cycles a program spends per KiB of weight (before any wait).

    python plugins/kernels_int8/benchmarks/sass_w8a16.py [--rows 16 64 200 512] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json

import triton

from qllm_kernels_int8.gemm_configs import swap_ab_config
from qllm_kernels_int8.testing import (compile_shared_b, compile_swap_ab, issue_rates,
                                       sass_summary)
from qllm_kernels_int8.triton_linear import gemm_config
from qllm_kernels_linear.testing import QWEN3_5_35B_A3B_SHAPES

INT8_SHAPES = ("out_proj", "gdn_in_proj", "qkv_proj")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def describe(kernel: str, compiled, tiles: tuple[int, int, int], programs: int, steps: int,
             warps: int, **config) -> dict:
    """One JSON line: the config, grid, steps and the compiled code's summary."""
    block_m, block_n, block_k = tiles
    summary = sass_summary(compiled)
    return dict(kernel=kernel, config=dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                           num_warps=warps, **config),
                programs=programs, steps=steps, **summary,
                **issue_rates(summary, warps, block_n * block_k))


def compare(rows: int, name: str) -> list[dict]:
    """Both GEMMs at ``rows`` rows through the projection ``name``."""
    n, k = QWEN3_5_35B_A3B_SHAPES[name]
    case = dict(shape=name, rows=rows, n=n, k=k, triton=triton.__version__)
    block_m, block_n, block_k, _, warps, stages = gemm_config(rows, n, k)
    shared_b = describe("shared_b", compile_shared_b(rows, n, k), (block_m, block_n, block_k),
                        cdiv(rows, block_m) * cdiv(n, block_n), cdiv(k, block_k), warps,
                        num_stages=stages)
    c = swap_ab_config(rows, n, k)
    swap_ab = describe("swap_ab", compile_swap_ab(rows, n, k), (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K),
                       cdiv(rows, c.BLOCK_M) * cdiv(n, c.BLOCK_N) * c.SPLIT_K,
                       cdiv(cdiv(k, c.BLOCK_K), c.SPLIT_K), c.num_warps,
                       num_stages=c.num_stages, SPLIT_K=c.SPLIT_K)
    return [dict(case, **shared_b), dict(case, **swap_ab)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 200, 512])
    parser.add_argument("--shapes", nargs="+", default=list(INT8_SHAPES),
                        choices=list(QWEN3_5_35B_A3B_SHAPES))
    args = parser.parse_args()
    for rows in args.rows:
        for name in args.shapes:
            for line in compare(rows, name):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
