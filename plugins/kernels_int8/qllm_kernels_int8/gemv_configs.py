"""Launch parameters of the 8-bit GEMV (``triton_gemv``) per shape: the rule
(``default_config``, and ``slot_moe_config`` for the MoE's small-batch path) and the candidates
that ``benchmarks/bench_int8.py --sweep`` times on a GPU to refine it. Pure Python (no Triton),
so the benchmark and the tests read them without compiling anything.

The configs are kernels_linear's ``GemvConfig`` (``BLOCK_N`` weight rows per program,
``BLOCK_K`` columns per loop step, warps, pipelining stages) for the dense GEMV, and
kernels_moe's ``MoeConfig`` with ``BLOCK_M == 1`` for the MoE's slot path (each GEMM's
``BLOCK_N`` counts output columns: the gated GEMM reads a gate and an up row per column).

The kernel is memory-bound and issues each weight byte once. Each thread holds whole chunks
of ``VECTOR`` = 8 columns (an 8-byte weight load, next to a 16-byte load of the same 8 columns
of ``x`` in bf16: the same register layout, so nothing moves between threads); the warps lie
side by side along K, so ``BLOCK_K`` is a multiple of ``WARP_COLUMNS * num_warps`` (smaller
steps would put threads across rows, where ``x`` and the weights no longer share a layout).

The rule comes from the sweep on the H200 (``gpu_run.sh bench-int8-sweep``,
``bench-int8-sweep-moe``, 2026-12-03, each kernel alone in a CUDA graph, L2 flushed): at every
shape of Qwen3.5-35B-A3B the fastest configs run many small programs, not few large ones. So:

- ``STEP_BYTES`` = 2 KB of weights per program and loop step, one chunk per thread and weight
  row (``BLOCK_K`` = ``WARP_COLUMNS`` per warp): 4 weight rows x 512 columns on 2 warps, or
  8 x 256 on 1 warp where K <= 512 (fewer loop steps would be left);
- fewer weight rows per program while the grid has under ``MIN_PROGRAMS`` programs (about 16
  per SM), the step's columns growing to keep 2 KB.

It picks the sweep's fastest at qkv [9216, 2048], the slot MoE's gate-up and down at one token
and its down at four (gate-up there: third, 2% behind). Where the sweep's fastest differs
(GDN in_proj: 4 x 256 on 1 warp; out_proj: 1 x 2,048 on 4 warps), ``SWEPT_GEMV`` holds it.
The previous rule (one loop step over K, up to 8 rows on up to 8 warps, 128 programs at
least) was 10-25% slower than the fastest at all seven shapes; in W3's decode step with PDL
the swept configs gave 494.9 against its 454.9 tok/s (step 2.055 against 2.271 ms). The
sweep's configs are the default where they exist; ``QLLM_INT8_GEMV_SWEPT=0``
(``qllm.switches``) takes the rule everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

from qllm.switches import env_switch
from qllm_kernels_linear.configs import GemvConfig, block_m, next_power_of_2, sweep_grid
from qllm_kernels_moe.configs import GemmConfig, MoeConfig

GEMV_MAX_ROWS = 4  # the GEMV serves decode batches 1-4 (the graphs' padded sizes 1, 2, 4)
VECTOR = 8  # weight columns per thread and chunk
WARP_COLUMNS = 32 * VECTOR  # columns one warp spans
MAX_WARPS = 8
STEP_BYTES = 2048  # weight bytes per program and loop step, by the rule
MIN_PROGRAMS = 2048  # per launch, by the rule: about 16 per SM (132 on the H200)
ACC_REGISTERS = 32  # fp32 accumulator registers per thread: BLOCK_M x BLOCK_N x chunks


# The sweep's fastest configs (see above), us alone against the rule's: the dense GEMV's per
# (rows, N, K), and the slot MoE GEMMs' per (slots, output columns, K, weight rows per column).
SWEPT_GEMV = {
    (1, 2048, 4096): GemvConfig(1, 2048, 4, 1),  # out_proj: 8.38 against 10.18
    (1, 12352, 2048): GemvConfig(4, 256, 1, 1),  # GDN in_proj: 14.05 against 17.09
    (1, 9216, 2048): GemvConfig(4, 512, 2, 1),  # attention qkv: 12.00 against 14.75
}
SWEPT_SLOT_GEMMS = {
    (9, 512, 2048, 2): GemvConfig(2, 512, 2, 1),  # gate-up, one token: 12.86 against 16.00
    (9, 2048, 512, 1): GemvConfig(8, 256, 1, 1),  # down, one token: 10.14 against 11.26
    (36, 512, 2048, 2): GemvConfig(2, 512, 1, 1),  # gate-up, 4 tokens: 29.73 against 39.36
    (36, 2048, 512, 1): GemvConfig(8, 256, 1, 1),  # down, 4 tokens: 20.45 against 20.74
}
SWEPT_ENV = "QLLM_INT8_GEMV_SWEPT"
SWEPT = env_switch(SWEPT_ENV)  # read once, at import: the configs are chosen at every launch


def _fit(m: int, k: int, programs: Callable[[int], int], rows_per_column: int = 1
         ) -> GemvConfig:
    """The rule for ``m`` input rows and K = ``k``, where ``programs(block_n)`` is the grid
    size and each of the ``block_n`` output columns reads ``rows_per_column`` weight rows."""
    weight_rows = 8 if k <= 2 * WARP_COLUMNS else 4
    block_n = max(1, weight_rows // rows_per_column)
    while block_n > 1 and (programs(block_n) < MIN_PROGRAMS
                           or block_m(m) * block_n * rows_per_column > ACC_REGISTERS):
        block_n //= 2
    step_columns = STEP_BYTES // (block_n * rows_per_column)
    block_k = max(WARP_COLUMNS, min(next_power_of_2(k), step_columns))
    warps = min(MAX_WARPS, block_k // WARP_COLUMNS)  # one chunk per thread and weight row
    return GemvConfig(block_n, warps * WARP_COLUMNS, warps, num_stages=1)


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The dense GEMV's config for ``m`` rows through ``weight [n, k]``: the sweep's where it
    has one (``SWEPT_GEMV``), unless ``QLLM_INT8_GEMV_SWEPT=0``; else the rule: at one row
    ``[12352, 2048]`` and ``[9216, 2048]`` take 4 rows x 512 columns (2 warps), ``[2048,
    4096]`` 1 row x 2,048 (8 warps)."""
    if SWEPT and (m, n, k) in SWEPT_GEMV:
        return SWEPT_GEMV[m, n, k]
    return _fit(m, k, lambda block_n: -(-n // block_n))


def slot_moe_config(num_slots: int, inter: int, hidden: int) -> MoeConfig:
    """The MoE slot path's rule for ``num_slots`` slots through experts of ``w13 [2 * inter,
    hidden]`` and ``w2 [hidden, inter]``: one program per slot and ``BLOCK_N`` columns. The
    sweep's configs where it has them (``SWEPT_SLOT_GEMMS``), unless
    ``QLLM_INT8_GEMV_SWEPT=0``; else the rule: at Qwen3.5-35B-A3B's 9 slots of one token,
    gate-up 2 columns (4 rows) x 512 (2 warps), down 8 rows x 256 (1 warp)."""
    swept = SWEPT_SLOT_GEMMS if SWEPT else {}
    up = swept.get((num_slots, inter, hidden, 2)) or _fit(
        1, hidden, lambda block_n: num_slots * -(-inter // block_n), rows_per_column=2)
    down = swept.get((num_slots, hidden, inter, 1)) or _fit(
        1, inter, lambda block_n: num_slots * -(-hidden // block_n))
    return MoeConfig(1, slot_gemm_config(up), slot_gemm_config(down))


def slot_gemm_config(config: GemvConfig) -> GemmConfig:
    """A GEMV config as the slot path's ``GemmConfig`` (``GROUP_M`` unused)."""
    return GemmConfig(config.BLOCK_N, config.BLOCK_K, 1, config.num_warps, config.num_stages)


SWEEP_STAGES = (1, 2)


def candidates(m: int, n: int, k: int, rows_per_column: int = 1) -> list[GemvConfig]:
    """The configs ``bench_int8.py --sweep`` times for ``m`` rows and K = ``k`` through ``n``
    output columns of ``rows_per_column`` weight rows each: kernels_linear's sweep grid with
    accumulators up to twice ``ACC_REGISTERS`` (one register per chunk here) and no deeper
    pipelining than 2 stages."""
    return sweep_grid(m, n, k, 2 * ACC_REGISTERS, SWEEP_STAGES, rows_per_column)
