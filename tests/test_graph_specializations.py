"""benchmarks/graph_specializations.py: the decode step's kernel-plugin launches captured on
meta tensors at the Qwen3.5-35B-A3B geometry, grouped into the variants Triton compiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qllm.testing.sm90 import sm90_compiler_missing

pytestmark = pytest.mark.skipif(sm90_compiler_missing() is not None,
                                reason=str(sm90_compiler_missing()))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
transformers = pytest.importorskip("transformers")

# (the GDN layer's gated norm runs in the recurrence's kernel up to 16 sequences)
STEP_KERNELS = {"_add_rms_norm_kernel", "_router_kernel", "_slot_gate_up_kernel",
                "_slot_down_kernel", "_conv_update_kernel", "_gated_delta_rule_kernel",
                "_qk_norm_rope_kernel", "_decode_split_kernel", "_decode_merge_kernel",
                "_gemv_kernel"}


def test_every_step_kernel_is_met_and_buckets_add_variants():
    import graph_specializations

    config = transformers.Qwen3_5MoeTextConfig()
    one = graph_specializations.variants(1, config)
    assert {key[0] for key in one} == STEP_KERNELS  # batch 1: slot MoE, GEMVs, with PDL
    assert all(dict(launch.options).get("launch_pdl") for launch in one.values())
    eight = graph_specializations.variants(8, config)  # buckets 1, 2, 4, 8
    names = {key[0] for key in eight}
    assert STEP_KERNELS | {"_align_kernel", "_expert_gemm_kernel"} == names
    assert set(one) < set(eight)
    larger = {key[0] for key in graph_specializations.variants(24, config)}  # ... 16, 24
    assert "_rms_norm_gated_kernel" in larger - names
