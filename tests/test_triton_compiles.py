"""TritonCompileLog: Triton's compiles counted per kernel, from Triton's own listener, and the
start-up line that reports them."""

from __future__ import annotations

import pytest
import torch

from qllm.engine.startup import StartupReport
from qllm.runner.compile_cache import CompileCache
from qllm.runner.triton_compiles import TritonCompileLog
from qllm.testing.sm90 import compile_for_sm90, sm90_compiler_missing


def test_summary_totals_and_orders_kernels_by_seconds():
    log = TritonCompileLog()
    log.record("moe_gemm", 2.0, cache_hit=False)
    log.record("moe_gemm", 1.5, cache_hit=False)
    log.record("rms_norm", 0.5, cache_hit=False)
    log.record("rms_norm", 0.01, cache_hit=True)
    summary = log.summary(top=1)
    assert (summary["compiled"], summary["cached"], summary["seconds"]) == (3, 1, 4.01)
    assert summary["top"] == [{"name": "moe_gemm", "compiled": 2, "cached": 0, "seconds": 3.5}]
    assert summary["by_phase"] == {"other": {"compiled": 3, "cached": 1, "seconds": 4.01}}
    assert log.line() == ("Triton JIT 3 compiled + 1 cached in 4.0 s "
                          "(moe_gemm 2 x 3.5 s, rms_norm 1 x 0.5 s; by phase: other 3 x 4.0 s)")


def test_compiles_count_under_the_start_up_phase_they_happen_in():
    report = StartupReport(CompileCache(None))
    log = report.triton_compiles
    with report.phase("graph_capture"):
        log.record("decode_split", 1.0, cache_hit=False)
        log.record("decode_merge", 0.5, cache_hit=False)
    with report.phase("warm_up"):
        log.record("chunk_h", 2.0, cache_hit=False)
    log.record("late", 0.25, cache_hit=True)  # outside any phase
    assert log.phase is None
    assert report.summary()["triton_jit"]["by_phase"] == {
        "graph_capture": {"compiled": 2, "cached": 0, "seconds": 1.5},
        "warm_up": {"compiled": 1, "cached": 0, "seconds": 2.0},
        "other": {"compiled": 0, "cached": 1, "seconds": 0.25}}
    assert "by phase: graph capture 2 x 1.5 s, warm up 1 x 2.0 s)" in report.ready()


def test_start_up_line_leaves_out_triton_when_nothing_compiled(tmp_path):
    report = StartupReport(CompileCache(None))
    assert "Triton JIT" not in report.ready()
    assert report.summary()["triton_jit"] == {"compiled": 0, "cached": 0, "seconds": 0.0,
                                              "top": [], "by_phase": {}}


@pytest.mark.skipif(sm90_compiler_missing() is not None, reason=str(sm90_compiler_missing()))
def test_listener_counts_a_real_compile_then_its_cache_hit(tmp_path, monkeypatch):
    import triton
    import triton.language as tl

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2,
                 mask=offsets < n)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    args = dict(x_ptr=torch.empty(64, device="meta"), n=64, BLOCK=64)
    report = StartupReport(CompileCache(None))
    with report.triton_compiles:
        compile_for_sm90(double, args, dict(num_warps=1))
        compile_for_sm90(double, args, dict(num_warps=1))  # the same key: from the disk cache
    line = report.ready()
    summary = report.summary()["triton_jit"]
    assert (summary["compiled"], summary["cached"]) == (1, 1)
    assert summary["top"][0]["name"] == "double" and summary["seconds"] > 0
    assert "Triton JIT 1 compiled + 1 cached" in line
    compile_for_sm90(double, args, dict(num_warps=2))  # after the block: no longer counted
    assert report.summary()["triton_jit"]["compiled"] == 1


def test_the_listener_is_put_back_after_a_failure():
    knobs = pytest.importorskip("triton").knobs

    before = knobs.compilation.listener
    log = TritonCompileLog()
    with pytest.raises(RuntimeError), log:
        assert knobs.compilation.listener == log._on_compile
        raise RuntimeError("the engine failed to build")
    assert knobs.compilation.listener is before
