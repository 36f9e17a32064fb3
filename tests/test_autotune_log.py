"""AutotuneLog: autotuned kernels' tuning runs counted per kernel, and the start-up line that
reports them."""

from __future__ import annotations

from qllm.engine.startup import StartupReport
from qllm.runner.autotune_log import AutotuneLog
from qllm.runner.compile_cache import CompileCache


def test_summary_totals_and_orders_kernels_by_seconds():
    log = AutotuneLog()
    log.record("chunk_h", 3.0)
    log.record("chunk_h", 2.0)
    log.record("cumsum", 0.5)
    summary = log.summary(top=1)
    assert (summary["keys"], summary["kernels"], summary["seconds"]) == (3, 2, 5.5)
    assert summary["top"] == [{"name": "chunk_h", "keys": 2, "seconds": 5.0}]
    assert log.line() == ("autotuned 3 keys of 2 kernels in 5.5 s "
                          "(chunk_h 2 x 5.0 s, cumsum 1 x 0.5 s)")


def test_start_up_line_reports_tuning_runs_and_leaves_them_out_when_none():
    report = StartupReport(CompileCache(None))
    assert "autotuned" not in report.line()
    assert report.summary()["autotune"] == {"keys": 0, "kernels": 0, "seconds": 0.0, "top": []}
    report.autotunes.record("chunk_h", 1.25)
    assert "autotuned 1 key of 1 kernel in 1.2 s (chunk_h 1 x 1.2 s)" in report.ready()
