"""benchmarks/bench_pdl_launch.py: its kernels compiled for sm_90 release and wait where the
cases say (the middle kernel's release before or after its wait, nothing read or stored before
a wait), and its intervals from hand-made stamps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qllm.testing.kernels import HAS_TRITON, INTERPRETING

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
if HAS_TRITON:
    import bench_pdl_launch as bench  # noqa: E402


def test_intervals_from_stamps():
    # first ends at 5,000 ns; two middle programs release at 5,600 and 5,800 and end at
    # 20,000 and 21,000; last enters at 19,000
    stamps = [5_000, 5_600, 20_000, 5_800, 21_000, 19_000]
    assert bench.timings(stamps, programs=2) == {
        "entry_after_release_us": 13.2, "entry_after_first_kernel_us": 14.0,
        "entry_after_first_end_us": -1.0, "release_spread_us": 0.2}


def test_profiled_intervals():
    # the profiler saw middle end at 30.0 us and last start at 30.5; the stamps: last entered
    # 2 us before middle's last program ended
    spans = {"_first_kernel": (0.0, 5.0), "_middle_kernel": (5.5, 30.0),
             "_last_kernel": (30.5, 31.0)}
    stamps = [5_000, 5_600, 20_000, 5_800, 21_000, 19_000]
    assert bench.profiled_intervals(spans, stamps, programs=2) == {
        "profiler_start_after_middle_end_us": 0.5, "stamps_entry_after_middle_end_us": -2.0}


@pytest.mark.skipif(INTERPRETING, reason="compiles for sm_90")
@pytest.mark.parametrize("release_before_wait", [True, False], ids=["before", "after"])
def test_kernels_release_and_wait_where_the_case_says(release_before_wait):
    from qllm.testing.pdl import gdc_summary
    from qllm.testing.sm90 import compile_for_sm90, sm90_compiler_missing

    if (missing := sm90_compiler_missing()) is not None:
        pytest.skip(missing)
    stamps = torch.empty(8, dtype=torch.int64, device="meta")
    kernels = {
        "first": (bench._first_kernel, dict(stamps_ptr=stamps, duration_ns=5000)),
        "middle": (bench._middle_kernel, dict(stamps_ptr=stamps, duration_ns=5000,
                                              RELEASE_BEFORE_WAIT=release_before_wait)),
        "last": (bench._last_kernel, dict(stamps_ptr=stamps, programs=3))}
    for name, (kernel, args) in kernels.items():
        summary = gdc_summary(compile_for_sm90(kernel, {**args, "USE_PDL": True},
                                               dict(num_warps=4)))
        assert summary["waits"] == summary["launch_dependents"] == 1, name
        assert summary["loads_before_wait"] == summary["stores_before_wait"] == [], name
        releases_first = release_before_wait if name == "middle" else True
        assert summary["launch_dependents_first"] is releases_first, name
