"""``benchmarks/bench_int8.py``'s sweep of the MoE's sorted path, planned on the CPU: at the
token counts of gpu_run.sh's ``bench-int8-sweep-sorted`` it times the path and the config the
op runs there, and fits that stage's time limit (the sweep itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("qllm_kernels_int8")
pytest.importorskip("triton")  # kernels_moe's bench_moe.py, whose grids the sweep takes

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_int8.py"
STAGE_TOKENS = (200, 16384)  # gpu_run.sh's bench-int8-sweep-sorted
BUDGET_S = 150  # per token count: two of them and the setup within the stage's 420 s


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_int8", BENCH)
    module = sys.modules["bench_int8"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_int8"]


@pytest.mark.parametrize("tokens", STAGE_TOKENS)
def test_sorted_sweep_plan(bench, tokens):
    """The op's sorted path and config at ``tokens`` (``moe_config``) is what the sweep
    compares against, each GEMM's rule among its distinct candidates, their count within the
    budget at the module's per-candidate estimate."""
    from qllm_kernels_int8.triton_moe import moe_config

    rule = moe_config(tokens, bench.EXPERTS, 2 * bench.INTER, bench.HIDDEN,
                      bench.SLOTS_PER_TOKEN)
    grid, candidates, table = bench.sorted_space(tokens)
    assert rule.BLOCK_M > 1 and table == rule == bench.table_config(tokens)
    for name, tiles in (("gate_up", rule.up), ("down", rule.down)):
        assert bench.SortedGemmConfig(rule.BLOCK_M, tiles) in candidates[name]
        assert len(set(candidates[name])) == len(candidates[name])
    count = sum(len(found) for found in candidates.values())
    assert count * (bench.SWEEP_COMPILE_S + bench.SWEEP_TIMING_S) < BUDGET_S, (grid, count)

