"""Launch parameters of the swap-AB W8A16 GEMM (``triton_w8a16``) per shape ``(M rows, N, K)``:
the rule (``swap_ab_config``) and the candidates that ``benchmarks/bench_int8.py --sweep``
times on a GPU to refine it (``swap_ab_candidates``). Pure Python (no Triton), so the benchmark
and the tests read them without compiling anything.

The kernel computes ``out^T [N, M] = w [N, K] @ x^T [K, M]``: the weight rows are the
tensor-core MMA's M dimension (64 rows per warpgroup, the operand Hopper's ``wgmma`` reads
from registers, where each int8 tile is converted), the input rows its N dimension (8 to 256
per instruction). The rule's reasoning (compiled for sm_90, not yet measured):

- ``BLOCK_M`` (input rows per program) covers ``M`` up to 256 rows (16 at least), so each
  weight tile is loaded and converted once; beyond 256 rows, tiles of 128, the shared-B
  GEMM's (at 512 rows in_proj takes 388 programs, two per SM, where 256-row tiles would leave
  194 programs of one per SM: 1.5 waves).
- ``BLOCK_N`` (weight rows per program) is 64 per warpgroup. Every program reads its
  ``[BLOCK_M, K]`` slice of ``x`` (from L2), so ``x`` is read ``N / BLOCK_N`` times: from 128
  input rows on, two warpgroups (8 warps, 128 weight rows) share each ``x`` tile, as many
  ``x`` bytes per MMA as the shared-B GEMM's 128 x 128 tiles; below, ``x`` is small and one
  warpgroup (64 rows) doubles the programs. (Two warpgroups at 256 rows: in_proj and qkv fill
  97 and 72 of 132 SMs; one warpgroup would make 193 and 144 programs, two per SM on some, as
  long, for twice the ``x`` reads.) Accumulator: ``BLOCK_N * BLOCK_M / (32 *
  num_warps)`` fp32 registers per thread, 128 at 256 rows.
- ``BLOCK_K``: an ``x`` tile of about ``STAGE_BYTES`` per pipeline stage, 64 to 256 columns
  within K (64 at 128-256 rows; 256 at 16-32 rows, where the weights dominate and their loads
  must be long enough to stream); ``num_stages`` 3 (two tiles in flight), 4 up to 64 rows,
  where the kernel streams weights and needs more bytes in flight.
- ``SPLIT_K``: the K range split between ``SPLIT_K`` programs (fp32 partial sums, added by a
  second launch), doubled while the programs fill under half the SMs, each split keeps
  ``MIN_SPLIT_STEPS`` loop steps and the partial sums (``SPLIT_K * M * N * 4`` bytes, written
  and read once) stay within the int8 weight's bytes: ``[2048, 4096]`` takes 4 at 200 rows
  (16 tiles), 4 at 16 (32 tiles), 2 at 512. The wide layers (in_proj, qkv: 72-97 tiles at
  200 rows) are not split.
"""

from __future__ import annotations

from dataclasses import dataclass

from qllm_kernels_linear.configs import next_power_of_2

ROWS_PER_WARPGROUP = 64  # weight rows of one wgmma (its M)
MIN_BLOCK_M = 16
MAX_BLOCK_M = 256  # the widest wgmma N
STAGE_BYTES = 16384  # x tile bytes per pipeline stage, roughly (see BLOCK_K above)
MIN_BLOCK_K, MAX_BLOCK_K = 64, 256
MAX_SPLIT_K = 8
MIN_SPLIT_STEPS = 4  # loop steps each split keeps at least
H200_SMS = 132
MAX_SHARED_BYTES = 232448  # per block on sm_90 (227 KiB)
MAX_ACC_REGISTERS = 128  # fp32 accumulator registers per thread


@dataclass(frozen=True)
class W8A16GemmConfig:
    """Launch parameters: ``BLOCK_N`` weight rows (output columns) and ``BLOCK_M`` input rows
    per program, ``BLOCK_K`` columns per loop step, ``SPLIT_K`` programs along K (1: no
    split), warps (a multiple of 4: ``BLOCK_N / 64`` warpgroups) and pipelining stages."""

    BLOCK_N: int
    BLOCK_M: int
    BLOCK_K: int
    SPLIT_K: int
    num_warps: int
    num_stages: int

    def shared_bytes(self) -> int:
        """Shared memory of the pipelined tiles (bf16 ``x``, int8 weights), an estimate."""
        return self.num_stages * self.BLOCK_K * (2 * self.BLOCK_M + self.BLOCK_N)

    def acc_registers(self) -> int:
        """fp32 accumulator registers per thread."""
        return self.BLOCK_N * self.BLOCK_M // (32 * self.num_warps)


def block_m(m: int) -> int:
    """Input rows per program: ``m`` rounded up to a power of two, at least 16; 128 beyond
    256 rows."""
    return max(MIN_BLOCK_M, next_power_of_2(m)) if m <= MAX_BLOCK_M else MAX_BLOCK_M // 2


def tiles(m: int, n: int, block_rows: int, block_n: int) -> int:
    """Output tiles of ``[m, n]`` (programs before the split along K)."""
    return -(-n // block_n) * -(-m // block_rows)


def split_k(m: int, k: int, block_k: int, num_tiles: int, sms: int) -> int:
    """The rule's ``SPLIT_K`` for ``m`` rows, K = ``k`` and ``num_tiles`` output tiles: doubled
    while the programs fit in ``sms``, each split keeps ``MIN_SPLIT_STEPS`` steps of
    ``block_k`` and the partial sums' bytes stay within the weight's (``4 * m`` per column
    and split against ``k``)."""
    split = 1
    while (2 * split <= MAX_SPLIT_K and 2 * split * num_tiles <= sms
           and k >= 2 * split * MIN_SPLIT_STEPS * block_k and 2 * split * 4 * m <= k):
        split *= 2
    return split


def swap_ab_config(m: int, n: int, k: int, sms: int = H200_SMS) -> W8A16GemmConfig:
    """The rule for ``m`` rows through ``weight [n, k]`` on ``sms`` multiprocessors. At 200
    rows: 128 weight rows x 256 input rows x 64 columns on 8 warps, ``[2048, 4096]`` split 4
    ways; at 16 rows: 64 x 16 x 256 on 4 warps, ``[2048, 4096]`` split 4 ways."""
    rows = block_m(m)
    warps = 8 if rows >= 128 else 4
    block_n = ROWS_PER_WARPGROUP * warps // 4
    block_k = max(MIN_BLOCK_K, min(MAX_BLOCK_K, STAGE_BYTES // (2 * rows)))
    block_k = max(MIN_BLOCK_M, min(block_k, next_power_of_2(k)))
    split = split_k(m, k, block_k, tiles(m, n, rows, block_n), sms)
    return W8A16GemmConfig(block_n, rows, block_k, split, warps, 4 if rows <= 64 else 3)


# The sweep's grid: the rule's BLOCK_M, half of it (twice the programs along M) and one tile
# over all of M up to 256 rows; one or two warpgroups; loop steps of 64-256 columns with ``x``
# tiles up to ``SWEEP_X_TILE_BYTES``; 3 or 4 stages; splits of 1-8 up to two waves of
# programs; within the shared memory and accumulator registers of one program.
SWEEP_WARPS = (4, 8)
SWEEP_BLOCK_K = (64, 128, 256)
SWEEP_STAGES = (3, 4)
SWEEP_SPLIT_K = (1, 2, 4, 8)
SWEEP_X_TILE_BYTES = 32768


def fits(config: W8A16GemmConfig) -> bool:
    """Whether one program of ``config`` fits the sweep's bounds: shared memory, accumulator
    registers, the ``x`` tile of a stage."""
    return (config.shared_bytes() <= MAX_SHARED_BYTES
            and config.acc_registers() <= MAX_ACC_REGISTERS
            and 2 * config.BLOCK_M * config.BLOCK_K <= SWEEP_X_TILE_BYTES)


def swap_ab_candidates(m: int, n: int, k: int, sms: int = H200_SMS
                       ) -> list[W8A16GemmConfig]:
    """The configs ``bench_int8.py --sweep`` times for ``m`` rows through ``weight [n, k]``."""
    rows = block_m(m)
    whole = max(MIN_BLOCK_M, min(MAX_BLOCK_M, next_power_of_2(m)))
    found = []
    for block_rows in sorted({rows, max(MIN_BLOCK_M, rows // 2), whole}):
        for warps in SWEEP_WARPS:
            block_n = ROWS_PER_WARPGROUP * warps // 4
            for block_k in SWEEP_BLOCK_K:
                for stages in SWEEP_STAGES:
                    for split in SWEEP_SPLIT_K:
                        config = W8A16GemmConfig(block_n, block_rows, block_k, split, warps,
                                                 stages)
                        programs = split * tiles(m, n, block_rows, block_n)
                        if (fits(config) and k >= split * block_k
                                and (split == 1 or programs <= 2 * sms)):
                            found.append(config)
    return found
