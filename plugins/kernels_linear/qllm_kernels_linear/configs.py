"""When the GEMV serves a call, and its launch parameters per shape ``(M rows, N, K)``: the rule
(``default_config``) and the candidates that ``benchmarks/bench_linear.py --sweep`` times on a
GPU to refine it (``candidates``). Both live here so a sweep result maps straight onto them.

The kernel is memory-bound: it must stream the ``[N, K]`` weight once at full bandwidth. Each
program reads ``BLOCK_N`` weight rows ``BLOCK_K`` columns at a time (contiguous, 16-byte loads)
and keeps a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` fp32 accumulator it reduces over K once, at the
end. The rule's reasoning, refined by the sweep at one row on the H200 (2026-11-30):

- ``BLOCK_K = 2 * 256 * num_warps``: one warp's 32 threads x 8 elements span 256 columns, and
  the warps lie side by side along K, each spanning its columns twice per step (two 16-byte
  loads per thread and row in flight). Each thread then holds the same columns of every
  weight row and of every ``x`` row, so ``x``'s load needs no layout conversion (compiled for
  sm_90: with fewer columns per warp, Triton moves ``x`` through shared memory, with a
  barrier, in every loop step). The sweep's candidates keep ``BLOCK_K`` a multiple of
  ``256 * num_warps``;
- ... or, at one row, up to four spans, where ``BLOCK_K`` then covers all of K and one weight
  row's tile fits the accumulator bound: a decode step's GEMV reads its first tile before its
  PDL wait (``triton_gemv``), and whole-K tiles (no loop, half the registers) let its
  resident programs hold more of the weight when the wait ends. At one row of ``[2048,
  4096]`` (the GDN ``out_proj`` and attention ``o_proj`` of Qwen3.5-35B-A3B) 2 x 4,096 tiles,
  67 registers, hold 15 of its 16.8 MB against 8.4 with 4 x 2,048 (123 registers): W3 ran
  388.7, 388.3 and 388.4 tok/s against 384.6 to 385.7 in five runs of the two-span rule
  (H100, one machine, 2026-12-07; 4 x 4,096 tiles on 4 or 8 warps, holding all of it: 384.5,
  the recurrence before the projection slowed by as much). Timed alone with the L2 flushed
  (the sweep below), the two-span tile is the faster one;
- enough programs to fill the GPU (``MIN_PROGRAMS``): small ``N`` (the MoE router's 264 rows)
  takes fewer rows per program instead of a split-K, which would need a second launch or
  atomics to combine partial sums;
- a bounded accumulator: ``BLOCK_M * BLOCK_N * BLOCK_K / (32 * num_warps)`` fp32 registers
  per thread, at most ``ACC_REGISTERS``;
- no software pipelining (``num_stages=1``): the loads go straight to registers. Staging
  them through shared memory (``cp.async``, 2 or 3 stages) lost at every shape of the sweep;
- one program per ``BLOCK_N`` rows. Grid-stride launches (2 to 16 programs per multiprocessor,
  each walking row blocks a grid apart, so no partial last wave) lost at every shape too, by
  0.1 to 0.8 us (2026-11-30).

Measured (``bench_linear.py --sweep --rows 1``, L2 flushed, us, rule before -> this rule's
config): ``[2048, 4096]`` 12.64 -> 10.91 (two spans; whole K, above, wins inside W3),
``[264, 2048]`` 6.88 -> about 6.4, ``[12352, 2048]`` 21.95 -> 18.50, ``[9216, 2048]`` 18.11 ->
15.62; cuBLAS 13.95, 9.15, 22.82, 18.46.

The vector of 8 elements assumes fp16 / bf16 (the dtypes the plugin serves); fp32 (the
interpreter tests) is served correctly, 8 elements being two 16-byte loads.
"""

from __future__ import annotations

from dataclasses import dataclass

# The kernel serves up to this many rows. The decode CUDA graphs run batches padded to 1, 2,
# 4, 8, ... rows, so this covers batches 1, 2 and 4. Each weight element costs one FMA per row
# on CUDA cores and the accumulator grows with the rows (``BLOCK_M``), while tensor-core GEMMs
# (cuBLAS) compute the extra rows at no cost.
MAX_GEMV_ROWS = 4
# Above one row the GEMV is taken only while rows x weight elements stay within this bound.
# Measured on the H200 with the rule's configs (bench_linear.py, 2026-11-30, us GEMV / cuBLAS):
# 1 row: on par or better on every shape ([2048, 4096] 7.4 / 10.2 and [264, 2048] 2.6 / 5.3 in
# the W3 step); 2 rows: [2048, 4096] 12.0 / 14.1 and [264, 2048] 7.2 / 9.4, but [12352, 2048]
# 27.6 / 22.5 and [9216, 2048] 22.1 / 18.3; 4 rows: [264, 2048] 7.3 / 9.2, [2048, 4096]
# 15.5 / 14.0. The bound keeps exactly the winners.
MAX_MULTI_ROW_ELEMENTS = 2 * 2048 * 4096


def serves(rows: int, n: int, k: int) -> bool:
    """Whether the GEMV (rather than cuBLAS) should compute ``rows`` rows through a weight
    ``[n, k]`` (see ``MAX_MULTI_ROW_ELEMENTS``)."""
    return rows == 1 or (1 < rows <= MAX_GEMV_ROWS and rows * n * k <= MAX_MULTI_ROW_ELEMENTS)


MIN_PROGRAMS = 128  # about one program per SM (132 on the H200)
ACC_REGISTERS = 64  # fp32 accumulator registers per thread
MAX_BLOCK_N = 8
MAX_WARPS = 4
THREAD_VECTOR = 8  # elements of a 16-byte load of fp16 / bf16
WARP_COLUMNS = 32 * THREAD_VECTOR  # columns one warp spans
WARP_SPANS = 2  # times each warp spans its columns per loop step
WHOLE_K_SPANS = 4  # ... or up to this many, where the tile then covers all of K


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: ``BLOCK_N`` weight rows per program, ``BLOCK_K`` columns per loop
    step, warps per program, and loop pipelining stages (1: none; above 1, ``cp.async`` loads
    run ``num_stages - 1`` steps ahead through shared memory)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def block_m(m: int) -> int:
    """Rows of the accumulator for ``m`` rows of input (a power of two)."""
    return next_power_of_2(m)


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The rule for ``m <= MAX_GEMV_ROWS`` rows and ``weight [n, k]`` (see the module
    docstring). At batch 1: ``[12352, 2048]`` and ``[9216, 2048]`` take 4 rows x 2,048
    columns per program (4 warps), ``[2048, 4096]`` 2 rows x 4,096, ``[264, 2048]`` 2 rows x
    2,048 (132 programs)."""
    rows, columns = block_m(m), next_power_of_2(k)
    warps = max(1, min(MAX_WARPS, columns // WARP_COLUMNS))
    block_k = max(16, min(columns, WARP_SPANS * WARP_COLUMNS * warps))
    if m == 1 and columns <= min(WHOLE_K_SPANS * WARP_COLUMNS, 32 * ACC_REGISTERS) * warps:
        block_k = columns  # whole K, a weight row's tile within the accumulator bound
    registers_per_row = max(1, block_k // (32 * warps))  # per (input row, weight row)
    block_n = MAX_BLOCK_N
    while block_n > 1 and (-(-n // block_n) < MIN_PROGRAMS
                           or rows * block_n * registers_per_row > ACC_REGISTERS):
        block_n //= 2
    return GemvConfig(block_n, block_k, warps, num_stages=1)


# The sweep's grid: per warp count, one, two or four warp spans per warp (BLOCK_K up to K, or
# one span per warp when K is smaller; whole spans: no layout conversion, see above);
# pipelining only where the loop has several steps.
SWEEP_BLOCK_N = (1, 2, 4, 8, 16, 32)
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_SPANS = (1, 2, 4)
SWEEP_STAGES = (1, 2, 3)


def sweep_grid(m: int, n: int, k: int, max_chunks: int, stages: tuple[int, ...],
               rows_per_column: int = 1) -> list[GemvConfig]:
    """The sweep's configs for ``m`` rows and K = ``k`` through ``n`` output columns of
    ``rows_per_column`` weight rows each, whose accumulator holds at most ``max_chunks``
    chunks of ``THREAD_VECTOR`` columns per thread (input rows x weight rows x spans), with
    each of ``stages`` (this GEMV's grid, and the 8-bit GEMV's)."""
    found = []
    for warps in SWEEP_WARPS:
        for spans in SWEEP_SPANS:
            block_k = spans * WARP_COLUMNS * warps
            if block_k > max(next_power_of_2(k), WARP_COLUMNS * warps):
                continue
            for block_n in SWEEP_BLOCK_N:
                chunks = block_m(m) * block_n * rows_per_column * spans
                if block_n <= n and chunks <= max_chunks:
                    found += [GemvConfig(block_n, block_k, warps, stage)
                              for stage in stages if stage == 1 or block_k < k]
    return found


def candidates(m: int, n: int, k: int) -> list[GemvConfig]:
    """The configs ``bench_linear.py --sweep`` times for ``m`` rows and ``weight [n, k]``:
    accumulators up to twice ``ACC_REGISTERS`` per thread."""
    return sweep_grid(m, n, k, 2 * ACC_REGISTERS // THREAD_VECTOR, SWEEP_STAGES)
