"""benchmarks/profile_step.py's elapsed-time attribution on hand-made kernel timelines: the
charges add up to the span whether kernels run back to back, leave idle gaps or overlap (as
under programmatic dependent launch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_step import elapsed_by_kernel, elapsed_by_kind  # noqa: E402


def test_back_to_back_and_gaps_charge_durations_and_the_gap_to_the_kernel_after():
    intervals = [(0.0, 10.0, "_gemv_kernel"), (10.0, 12.0, "_conv_update_kernel"),
                 (15.0, 20.0, "_gemv_kernel")]  # 3 us idle before the second GEMV
    assert elapsed_by_kind(intervals) == {"gemm": 18.0, "gdn": 2.0}


def test_overlapping_kernels_charge_only_what_they_add_and_sum_to_the_span():
    """Under PDL a kernel starts inside the one before (its programs wait there): charged from
    the previous end; one that ends inside the kernels before it is charged nothing."""
    intervals = [(0.0, 10.0, "_gemv_kernel"), (6.0, 14.0, "_router_kernel"),
                 (7.0, 12.0, "_add_rms_norm_kernel"), (13.0, 30.0, "_slot_gate_up_kernel")]
    charged = elapsed_by_kind(intervals)
    assert charged == {"gemm": 10.0, "moe": 20.0}
    assert sum(charged.values()) == pytest.approx(30.0)


def test_elapsed_by_kernel_splits_a_kind_per_unit_largest_first():
    """Two units of a router, a gate-up and a down (all "moe"): each kernel's charge and
    launches per unit, the costliest first, cut to ``most``."""
    unit = [(0.0, 4.0, "_router_kernel"), (2.0, 20.0, "_slot_gate_up_kernel"),
            (15.0, 28.0, "_slot_down_kernel")]
    intervals = unit + [(start + 30.0, end + 30.0, name) for start, end, name in unit]
    assert elapsed_by_kernel(intervals, steps=2) == {
        "_slot_gate_up_kernel": [16.0, 1.0], "_slot_down_kernel": [8.0, 1.0],
        "_router_kernel": [5.0, 1.0]}  # (4 + 6) / 2: the second also the 2 us idle before it
    assert list(elapsed_by_kernel(intervals, steps=2, most=1)) == ["_slot_gate_up_kernel"]

