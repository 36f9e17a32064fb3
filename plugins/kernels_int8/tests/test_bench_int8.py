"""``benchmarks/bench_int8.py``'s sweep of the MoE's sorted path, int8 and fp8, on the CPU: at
the token counts of gpu_run.sh's ``bench-int8-sweep-sorted`` and ``bench-fp8-sweep-sorted``
it times the path and the config the op runs there, and fits that stage's time limit (the
sweep itself needs a GPU); under the Triton interpreter at tiny shapes, its calls (each GEMM
alone on the format's inputs, gate-up then down) give the op's output and the reference's."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("qllm_kernels_int8")
pytest.importorskip("triton")  # kernels_moe's bench_moe.py, whose grids the sweep takes

from qllm.testing.kernels import interpreted, interpreter_driver  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_int8.py"
GPU_RUN = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_run.sh"
STAGES = {"int8": "bench-int8-sweep-sorted", "fp8": "bench-fp8-sweep-sorted"}
SETUP_S = 60  # per token count: the weights, the whole op's, bf16's and int8's times, the check


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_int8", BENCH)
    module = sys.modules["bench_int8"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_int8"]


def stage(name: str) -> tuple[int, list[int], str]:
    """gpu_run.sh's stage ``name``: its time limit, its ``--moe-tokens`` and ``--format``."""
    match = re.search(rf"^\s+{re.escape(name)}\) .*? run \S+ (\d+) python3 (.*?);;",
                      GPU_RUN.read_text(), re.M | re.S)
    assert match, f"gpu_run.sh has no stage {name}"
    argv = match.group(2).replace("\\\n", " ").split()
    assert "bench_int8.py" in argv[0] and "--sweep" in argv, argv
    tokens = itertools.takewhile(str.isdigit, argv[argv.index("--moe-tokens") + 1:])
    fmt = argv[argv.index("--format") + 1] if "--format" in argv else "int8"
    return int(match.group(1)), [int(t) for t in tokens], fmt


@pytest.mark.parametrize("fmt", STAGES)
def test_sorted_sweep_plan(bench, fmt):
    """At each of the stage's token counts, the op's sorted path and config (``moe_config``)
    is what the sweep compares against, each GEMM's rule (as the op fits it) among its
    distinct candidates; fp8's candidates keep ``BLOCK_K`` within a scale block and try the
    ``BLOCK_M`` of its ``wgmma``. The candidates' count, at the module's per-candidate
    estimate, and the setup fit the stage's time limit."""
    from qllm_kernels_int8.triton_moe import _fit, moe_config

    limit, stage_tokens, stage_fmt = stage(STAGES[fmt])
    block = bench.SCALE_BLOCKS[fmt]
    assert stage_fmt == fmt and stage_tokens
    total_s = 0.0
    for tokens in stage_tokens:
        rule = moe_config(tokens, bench.EXPERTS, 2 * bench.INTER, bench.HIDDEN,
                          bench.SLOTS_PER_TOKEN, block)
        grid, candidates, table = bench.sorted_space(tokens, fmt=fmt)
        assert rule.BLOCK_M > 1 and table == rule == bench.table_config(tokens, fmt)
        for name, tiles in (("gate_up", rule.up), ("down", rule.down)):
            assert bench.SortedGemmConfig(rule.BLOCK_M, _fit(tiles, block)) in candidates[name]
            assert len(set(candidates[name])) == len(candidates[name])
            assert all(_fit(c.tiles, block) == c.tiles for c in candidates[name])
        if block is not None:
            decode = grid == "decode"
            block_ms = {c.BLOCK_M for found in candidates.values() for c in found}
            assert block_ms >= {rule.BLOCK_M, *bench.FP8_BLOCK_MS[decode], 64}, block_ms
        total_s += bench.sorted_estimate_s(candidates)
    assert total_s + SETUP_S * len(stage_tokens) < limit, (fmt, total_s, limit)


test_triton_interpreter = interpreter_driver(__file__)


# name -> (tokens, experts, top_k, hidden, intermediate): a decode batch (16-slot blocks) and
# one whose experts see many slots (64-slot blocks, grouped launch orders)
TINY = {"decode-t9-e8": (9, 8, 2, 64, 32), "prefill-t80-e4": (80, 4, 2, 64, 32)}


@interpreted
@pytest.mark.parametrize("fmt", STAGES)
@pytest.mark.parametrize("shape", TINY.values(), ids=TINY.keys())
def test_interpreted_sorted_sweep_calls(bench, monkeypatch, shape, fmt):
    """At each ``BLOCK_M`` of the plan, the first candidate of each GEMM timed alone as
    ``sweep_sorted`` chains them (gate-up on ``x``, down on its output, each on the format's
    inputs) gives what the whole op gives at those tiles, and the reference's output; fp8's
    activations quantized by torch (the interpreter's e4m3 cast is off by a bit: see
    ``test_kernels_int8``)."""
    from qllm_kernels_int8 import quant
    from qllm_kernels_moe.configs import MoeConfig
    from qllm_kernels_moe.triton_align import moe_align_triton

    tokens, experts, top_k, hidden, inter = shape
    for name, value in dict(EXPERTS=experts, TOP_K=top_k, SLOTS_PER_TOKEN=top_k + 1,
                            HIDDEN=hidden, INTER=inter, DTYPE=torch.float32,
                            DEVICE="cpu").items():
        monkeypatch.setattr(bench, name, value)
    case = bench.MoeCase(tokens, quantize=quant.quantize_fp8_groups)
    _, candidates, _ = bench.sorted_space(tokens, fmt=fmt)
    slots = tokens * (top_k + 1)
    reference = case.sorted_reference(fmt).view(slots, hidden)
    for block_m in sorted({c.BLOCK_M for c in candidates["down"]}):
        gate_up, down = (next(c for c in candidates[name] if c.BLOCK_M == block_m)
                         for name in ("gate_up", "down"))
        sorts = {block_m: moe_align_triton(case.inputs.topk_ids, experts + 1, block_m)}
        h = case.sorted_gemm(fmt, True, case.sorted_inputs(case.inputs.x, fmt), sorts,
                             gate_up)()  # [S, I]
        out = case.sorted_gemm(fmt, False, case.sorted_inputs(h, fmt), sorts, down)()
        whole = case.sorted_op(fmt, MoeConfig(block_m, gate_up.tiles, down.tiles))()
        torch.testing.assert_close(out, whole.view(slots, hidden), atol=0, rtol=0)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
