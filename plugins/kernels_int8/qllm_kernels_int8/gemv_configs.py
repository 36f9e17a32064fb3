"""Launch parameters of the 8-bit GEMV (``triton_gemv``) per shape: the rule
(``default_config``, and ``slot_moe_config`` for the MoE's small-batch path) and the candidates
that ``benchmarks/bench_int8.py --sweep`` times on a GPU to refine it. Pure Python (no Triton),
so the benchmark and the tests read them without compiling anything.

The configs are kernels_linear's ``GemvConfig`` (``BLOCK_N`` weight rows per program,
``BLOCK_K`` columns per loop step, warps, pipelining stages) for the dense GEMV, and
kernels_moe's ``MoeConfig`` with ``BLOCK_M == 1`` for the MoE's slot path (each GEMM's
``BLOCK_N`` counts output columns: the gated GEMM reads a gate and an up row per column).

The kernel is memory-bound and issues each weight byte once: what bounds it is the bytes in
flight (loads issued before the first returns), so the rule sizes the per-thread loads rather
than copying the bf16 GEMV's tiles, which at 1 byte per weight would move half the bytes per
round trip:

- each thread holds whole chunks of ``VECTOR`` = 8 columns (an 8-byte weight load, next to a
  16-byte load of the same 8 columns of ``x`` in bf16: the same register layout, so nothing
  moves between threads); the warps lie side by side along K, so ``BLOCK_K`` is a multiple of
  ``WARP_COLUMNS * num_warps`` (smaller steps put threads across rows, where ``x`` and the
  weights no longer share a layout);
- one loop step covers K where it can (``SPANS`` chunks per thread and row, up to
  ``MAX_WARPS`` warps): 2,048 columns on 4 warps, 4,096 on 8, 512 on 1;
- ``BLOCK_N`` up to ``MAX_BLOCK_N`` weight rows (8 rows x 2 chunks x 8 bytes: 128 bytes in
  flight per thread, as the bf16 GEMV's tuned 4 rows x 2 x 16 bytes), fewer while the grid
  has under ``MIN_PROGRAMS`` programs or the ``[BLOCK_M, BLOCK_N, chunks]`` fp32 accumulator
  would pass ``ACC_REGISTERS`` per thread.

The sweep on the H200 (``gpu_run.sh bench-int8-sweep``, ``bench-int8-sweep-moe``, 2026-12-03,
each kernel alone in a CUDA graph, L2 flushed) found every shape of Qwen3.5-35B-A3B 10-25%
faster with smaller programs than the rule's: several loop steps of 256-2,048 columns on 1-4
warps, 2,048-3,088 programs (``SWEPT_GEMV``, ``SWEPT_SLOT_GEMMS``). In W3's decode step with
PDL too, though there the rule's one-step programs load all their weights before the wait and
the swept ones a loop step's: 494.9 against 454.9 tok/s (step 2.055 against 2.271 ms; same
machine, ``QLLM_INT8_GEMV_SWEPT=1`` then ``0``). So the swept configs are the default where
they exist; ``QLLM_INT8_GEMV_SWEPT=0`` (``qllm.switches``) takes the rule everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

from qllm.switches import env_switch
from qllm_kernels_linear.configs import GemvConfig, block_m, next_power_of_2
from qllm_kernels_moe.configs import GemmConfig, MoeConfig

GEMV_MAX_ROWS = 4  # the GEMV serves decode batches 1-4 (the graphs' padded sizes 1, 2, 4)
VECTOR = 8  # weight columns per thread and chunk
WARP_COLUMNS = 32 * VECTOR  # columns one warp spans
SPANS = 2  # chunks per thread and row in one loop step, by the rule
MAX_WARPS = 8
MAX_BLOCK_N = 8
MIN_PROGRAMS = 128  # about one program per SM (132 on the H200)
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


def _swept() -> bool:
    return env_switch(SWEPT_ENV)


def _fit(m: int, k: int, programs: Callable[[int], int], rows_per_column: int = 1
         ) -> GemvConfig:
    """The rule for ``m`` input rows and K = ``k``, where ``programs(block_n)`` is the grid
    size and each of the ``block_n`` output columns reads ``rows_per_column`` weight rows."""
    warps = max(1, min(MAX_WARPS, next_power_of_2(k) // (SPANS * WARP_COLUMNS)))
    block_k = max(VECTOR, min(next_power_of_2(k), SPANS * WARP_COLUMNS * warps))
    chunks = max(1, block_k // (WARP_COLUMNS * warps))  # per thread and weight row
    block_n = MAX_BLOCK_N // rows_per_column
    while block_n > 1 and (programs(block_n) < MIN_PROGRAMS or block_m(m) * block_n
                           * rows_per_column * chunks > ACC_REGISTERS):
        block_n //= 2
    return GemvConfig(block_n, block_k, warps, num_stages=1)


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The dense GEMV's rule for ``m`` rows through ``weight [n, k]``. At one row:
    ``[12352, 2048]`` and ``[9216, 2048]`` take 8 rows x 2,048 columns (4 warps), ``[2048,
    4096]`` 8 rows x 4,096 (8 warps); at 4 rows, 4 weight rows. The sweep's config where it
    has one (``SWEPT_GEMV``), unless ``QLLM_INT8_GEMV_SWEPT=0``."""
    if _swept() and (m, n, k) in SWEPT_GEMV:
        return SWEPT_GEMV[m, n, k]
    return _fit(m, k, lambda block_n: -(-n // block_n))


def slot_moe_config(num_slots: int, inter: int, hidden: int) -> MoeConfig:
    """The MoE slot path's rule for ``num_slots`` slots through experts of ``w13 [2 * inter,
    hidden]`` and ``w2 [hidden, inter]``: one program per slot and ``BLOCK_N`` columns. At
    Qwen3.5-35B-A3B's 9 slots of one token: gate-up 4 columns (8 rows) x 2,048 (4 warps),
    down 8 rows x 512 (1 warp). The sweep's configs where it has them (``SWEPT_SLOT_GEMMS``),
    unless ``QLLM_INT8_GEMV_SWEPT=0``."""
    swept = SWEPT_SLOT_GEMMS if _swept() else {}
    up = swept.get((num_slots, inter, hidden, 2)) or _fit(
        1, hidden, lambda block_n: num_slots * -(-inter // block_n), rows_per_column=2)
    down = swept.get((num_slots, hidden, inter, 1)) or _fit(
        1, inter, lambda block_n: num_slots * -(-hidden // block_n))
    return MoeConfig(1, slot_gemm_config(up), slot_gemm_config(down))


def slot_gemm_config(config: GemvConfig) -> GemmConfig:
    """A GEMV config as the slot path's ``GemmConfig`` (``GROUP_M`` unused)."""
    return GemmConfig(config.BLOCK_N, config.BLOCK_K, 1, config.num_warps, config.num_stages)


# The sweep's grid: per warp count, one, two or four chunks per thread and row (BLOCK_K up to
# K, or one warp span per warp when K is smaller); accumulators up to twice ACC_REGISTERS;
# pipelining only where the loop has several steps.
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_SPANS = (1, 2, 4)
SWEEP_BLOCK_N = (1, 2, 4, 8, 16, 32)
SWEEP_STAGES = (1, 2)


def candidates(m: int, n: int, k: int, rows_per_column: int = 1) -> list[GemvConfig]:
    """The configs ``bench_int8.py --sweep`` times for ``m`` rows and K = ``k`` through ``n``
    output columns of ``rows_per_column`` weight rows each."""
    found = []
    for warps in SWEEP_WARPS:
        for spans in SWEEP_SPANS:
            block_k = spans * WARP_COLUMNS * warps
            if block_k > max(next_power_of_2(k), WARP_COLUMNS * warps):
                continue
            for block_n in SWEEP_BLOCK_N:
                accumulator = block_m(m) * block_n * rows_per_column * spans
                if block_n <= n and accumulator <= 2 * ACC_REGISTERS:
                    found += [GemvConfig(block_n, block_k, warps, stages)
                              for stages in SWEEP_STAGES if stages == 1 or block_k < k]
    return found
