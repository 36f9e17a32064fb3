"""The opt-in fused GDN decode (``QLLM_GDN_DECODE=fused``: op ``gdn_decode_fused``, kernel
``triton_fused_decode``) against the composition of the three plain-torch references
(``ops.gdn_decode_fused_reference``: ``qllm.ops.gdn`` conv update and decode, ``qllm.ops.norm``
gated RMSNorm), and against the three-kernel path it replaces.

- CUDA (skipped without a GPU): Qwen3.5-35B-A3B geometry and two others, bf16 activations, fp32
  and bf16 states in the models' layouts and contiguous, batch 1..512 with slots out of order
  and padding rows, three chained steps; CUDA-graph replay; ``opcheck``.
- CPU: the registration switch, the fake path under ``torch.compile(fullgraph=True)``; under the
  Triton interpreter (``test_fused_triton_interpreter`` reruns the ``interpreted`` tests in a
  subprocess, then compiles their launches for sm_90) the kernel at tiny shapes (value heads
  per key head 1, 2 and 3, dv not a power of two, conv widths 3 and 4), batch 1..12 with
  padding rows, fresh / mixed / all initial states, fp32 and bf16 states and activations; and
  the launch configurations compiled offline for sm_90 with no spills (skipped where the
  installed Triton cannot compile offline).
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch

pytest.importorskip("qllm_kernels_gdn")

from qllm.batch import ForwardBatch  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.kernels import (HAS_TRITON, INTERPRETING, called_ops, cuda,  # noqa: E402
                                  graphs_traced_by, interpreted, interpreter_driver,
                                  run_interpreted_tests)
from qllm.testing.sm90 import resource_usage, sm90_compiler_missing  # noqa: E402
from qllm_kernels_gdn import ops, plugin, testing  # noqa: E402
from qllm_kernels_gdn.testing import (GPU_GEOMETRIES, QWEN3_5_35B_A3B,  # noqa: E402
                                      STATE_DTYPES, TOLERANCE, GDNGeometry, assert_close, assert_states,
                                      conv_state_tolerance, fused_decode_inputs,
                                      has_state_flags, random_batch)

state_layouts = pytest.mark.parametrize("contiguous_state", [False, True],
                                        ids=["model-layout", "contiguous"])

GPU_DECODE = {"b1": (1, 0), "b3-pad1": (3, 1), "b64": (64, 0), "b200-pad8": (200, 8),
              "b512": (512, 0)}  # batch -> (sequences, padding rows)
GPU_SLOTS = 512

TINY_GEOMETRIES = {
    "gqa2-dk16-dv8": GDNGeometry(2, 4, 16, 8),
    "mha-dk16-dv12-k3": GDNGeometry(2, 2, 16, 12, conv_kernel=3),
    "gqa3-dk8-dv16": GDNGeometry(2, 6, 8, 16),  # 3 value heads per key head: a masked tile
}
TINY_DECODE = {"b1": (1, 0), "b5-pad2": (5, 2), "b12-pad3": (12, 3)}
TINY_SLOTS = 16


def _state_tolerance(dtype: torch.dtype, state_dtype: torch.dtype) -> float:
    return max(TOLERANCE[dtype], TOLERANCE[state_dtype])


def _output_tolerance(dtype: torch.dtype, state_dtype: torch.dtype) -> float:
    """Of the output against the reference: the state's, but 5e-2 for a bf16 state under the
    interpreter, whose fp32 -> bf16 rounding toward zero (see ``conv_state_tolerance``) drifts
    the state over the chained steps while the RMSNorm scales each row's error up to the row's
    unit RMS (up to 3e-2 seen; the three-kernel path drifts the same: against it the state's
    tolerance holds, the outputs were equal bit for bit)."""
    if INTERPRETING and state_dtype == torch.bfloat16:
        return 5e-2
    return _state_tolerance(dtype, state_dtype)


def _unfused(x, weight, conv_state, a, b, A_log, dt_bias, ssm_state, z, norm_weight, eps,
             batch):
    """The three-kernel path the fused op replaces (this plugin's ops, as the layer calls
    them)."""
    num_v_heads, dk, dv = ssm_state.shape[1:]
    num_k_heads = (x.shape[1] - num_v_heads * dv) // (2 * dk)
    mixed = ops.causal_conv1d_update(x, weight, conv_state, batch)
    q, k, v = mixed.split([num_k_heads * dk, num_k_heads * dk, num_v_heads * dv], dim=-1)
    o = ops.gdn_decode(q.unflatten(-1, (num_k_heads, dk)), k.unflatten(-1, (num_k_heads, dk)),
                       v.unflatten(-1, (num_v_heads, dv)), a, b, A_log, dt_bias, ssm_state,
                       batch)
    return ops.rms_norm_gated(o, z, norm_weight, eps)


def check_fused_decode(geometry: GDNGeometry, num_seqs: int, num_padding: int,
                       has_state: str, dtype: torch.dtype, state_dtype: torch.dtype,
                       num_slots: int, device: str, contiguous_state: bool = False,
                       against_unfused: bool = True, **launch) -> None:
    """Three chained steps (the first with ``has_state``'s flags, then all with state): the
    output and both states against the reference composition, and the output against the
    three-kernel path on a copy of the states. ``launch``: ``heads`` / ``num_warps``
    overrides (the kernel called directly)."""
    tol = _state_tolerance(dtype, state_dtype)
    out_tol = _output_tolerance(dtype, state_dtype)
    states = None
    for step in range(3):
        batch = random_batch([1] * num_seqs, num_slots,
                             has_state_flags(num_seqs, has_state) if step == 0 else True, num_padding,
                             device=device, seed=num_seqs)
        x = fused_decode_inputs(batch, geometry, num_slots, dtype, state_dtype, seed=step,
                                contiguous_state=contiguous_state)
        if states is None:
            states = (x.conv_state, x.ssm_state)
            refs = tuple(state.clone() for state in states)
            before = tuple(state.clone() for state in states)
        x = dataclasses.replace(x, conv_state=states[0], ssm_state=states[1])
        ref_in = dataclasses.replace(x, conv_state=refs[0], ssm_state=refs[1])
        if against_unfused:
            unfused_in = dataclasses.replace(x, conv_state=states[0].clone(),
                                             ssm_state=states[1].clone())
            unfused = _unfused(*unfused_in.args())
        ref = ops.gdn_decode_fused_reference(*ref_in.args())
        if launch:
            from qllm_kernels_gdn.triton_fused_decode import fused_decode

            cache = batch.caches["recurrent_slot"]
            out = fused_decode(*x.args()[:-1], cache.slots, cache.has_initial_state, **launch)
        else:
            out = ops.gdn_decode_fused(*x.args())
        assert out.shape == (num_seqs + num_padding, geometry.num_v_heads, geometry.head_v_dim)
        assert out.is_contiguous()
        assert_close(out[:num_seqs], ref[:num_seqs], out_tol)
        if against_unfused:
            assert_close(out[:num_seqs], unfused[:num_seqs], tol)
            assert_states(states[1], unfused_in.ssm_state, before[1], batch, tol)
        assert_states(states[0], refs[0], before[0], batch, conv_state_tolerance(state_dtype))
        assert_states(states[1], refs[1], before[1], batch, tol)


def opcheck_fused(device: str, dtype: torch.dtype) -> None:
    """``torch.library.opcheck`` on the custom op (schema incl. both mutations, fake tensor,
    AOT dispatch)."""
    batch = random_batch([1] * 3, TINY_SLOTS, [True, False, True], 1, device=device)
    x = fused_decode_inputs(batch, TINY_GEOMETRIES["gqa2-dk16-dv8"], TINY_SLOTS, dtype,
                            torch.float32)
    cache = batch.caches["recurrent_slot"]
    torch.library.opcheck(ops.fused_decode, (*x.args()[:-1], cache.slots,
                                             cache.has_initial_state))


# ----------------------------------------------------------------------------- CUDA

@cuda
@state_layouts
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", GPU_DECODE.values(), ids=GPU_DECODE.keys())
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES.values(), ids=GPU_GEOMETRIES.keys())
def test_fused_decode_parity(geometry, batch, state_dtype, contiguous_state):
    check_fused_decode(geometry, *batch, "mixed", torch.bfloat16, state_dtype, GPU_SLOTS,
                       "cuda", contiguous_state)


@cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("launch", [dict(heads=1, num_warps=8), dict(heads=1, num_warps=16),
                                    dict(heads=2, num_warps=8)],
                         ids=["1head-8w", "1head-16w", "2heads-8w"])
def test_fused_decode_launch_configs(launch, state_dtype):
    """The configurations ``bench_gdn.py --sweep-fused`` times (spilling or not)."""
    check_fused_decode(QWEN3_5_35B_A3B, 200, 8, "mixed", torch.bfloat16, state_dtype,
                       GPU_SLOTS, "cuda", **launch)


@cuda
def test_fused_decode_cuda_graph_replay():
    """Captured once, replayed after inputs, slots and state flags change in place."""
    batch = random_batch([1] * 64, GPU_SLOTS, has_state_flags(64, "mixed"), 8, device="cuda")
    x = fused_decode_inputs(batch, QWEN3_5_35B_A3B, GPU_SLOTS, torch.bfloat16, torch.float32)
    ops.gdn_decode_fused(*x.args())  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gdn_decode_fused(*x.args())
    cache = batch.caches["recurrent_slot"]
    for seed in range(2):
        moved = random_batch([1] * 64, GPU_SLOTS, has_state_flags(64, "mixed")[::-1], 8, device="cuda",
                             seed=100 + seed)
        moved_cache = moved.caches["recurrent_slot"]
        cache.slots.copy_(moved_cache.slots)
        cache.has_initial_state.copy_(moved_cache.has_initial_state)
        for t in (x.x, x.a, x.b, x.z):
            t.normal_()
        before = (x.conv_state.clone(), x.ssm_state.clone())
        ref_in = dataclasses.replace(x, conv_state=before[0].clone(),
                                     ssm_state=before[1].clone())
        ref = ops.gdn_decode_fused_reference(*ref_in.args())
        graph.replay()
        assert_close(out[:64], ref[:64], TOLERANCE[torch.bfloat16])
        assert_states(x.conv_state, ref_in.conv_state, before[0], batch, 0.0)
        assert_states(x.ssm_state, ref_in.ssm_state, before[1], batch,
                       TOLERANCE[torch.bfloat16])


@cuda
def test_fused_opcheck_cuda():
    opcheck_fused("cuda", torch.bfloat16)


# ----------------------------------------------------------------------------- CPU

def _registry_kernels(monkeypatch, fused: bool, device: str, dtype=torch.bfloat16):
    monkeypatch.setattr(plugin, "FUSED_DECODE", fused)
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    return registry.kernels(torch.device(device), dtype)


def test_registered_only_when_switched_on(monkeypatch):
    """Off (the default): no ``gdn_decode_fused`` op, so the layer keeps its three ops. On: the
    reference on the CPU, the Triton kernel on CUDA; every other op as before."""
    for device in ("cpu", "cuda"):
        off = _registry_kernels(monkeypatch, False, device)
        assert "gdn_decode_fused" not in off.names()
        on = _registry_kernels(monkeypatch, True, device)
        expected = "triton" if device == "cuda" and HAS_TRITON else "torch"
        names = on.names()
        assert names.pop("gdn_decode_fused") == expected
        assert names == off.names()
        assert getattr(off, "gdn_decode_fused", None) is None  # what the layer checks


def test_switch_values():
    """``QLLM_GDN_DECODE`` (read at import) takes ``fused`` or ``unfused`` (the default);
    anything else fails at import."""
    import os
    import subprocess
    import sys

    def imported(value: str | None) -> subprocess.CompletedProcess:
        env = {key: val for key, val in os.environ.items() if key != "QLLM_GDN_DECODE"}
        env.update({} if value is None else {"QLLM_GDN_DECODE": value})
        return subprocess.run([sys.executable, "-c", "from qllm_kernels_gdn import plugin; "
                               "print(plugin.FUSED_DECODE)"], env=env, capture_output=True,
                              text=True, timeout=120)

    for value, printed in (("fused", "True"), ("unfused", "False"), (None, "False")):
        result = imported(value)
        assert result.returncode == 0 and result.stdout.strip() == printed, result.stderr
    result = imported("yes")
    assert result.returncode != 0 and "QLLM_GDN_DECODE='yes'" in result.stderr


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, ForwardBatch):
        return dataclasses.replace(value, **{f.name: _to_meta(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def test_compile_fullgraph_on_fake_path():
    """Dynamo and AOT autograd trace the registered function into one graph holding the custom
    op, whose fake gives ``[B, Hv, dv]`` (meta tensors: no kernel runs)."""
    geometry = TINY_GEOMETRIES["gqa2-dk16-dv8"]
    batch = random_batch([1] * 3, TINY_SLOTS, True)
    args = [_to_meta(arg) for arg in fused_decode_inputs(batch, geometry, TINY_SLOTS,
                                                         torch.bfloat16, torch.float32).args()]

    def run(backend):
        out = torch.compile(ops.gdn_decode_fused, fullgraph=True, backend=backend)(*args)
        assert tuple(out.shape) == (3, geometry.num_v_heads, geometry.head_v_dim)
        assert out.device.type == "meta" and out.dtype == torch.bfloat16

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph)[0] == torch.ops.qllm_gdn.fused_decode.default
    assert all(target is operator.getitem for target in called_ops(graph)[1:])


SASS_CASES = {  # (state dtype, heads per tile, warps): None = the launch rule's
    "rule-state_bf16": (torch.bfloat16, None, None),  # 2 heads x 8 warps
    "rule-state_fp32": (torch.float32, None, None),  # 1 head x 8 warps
    "1head-8w-state_bf16": (torch.bfloat16, 1, 8),
    "1head-16w-state_bf16": (torch.bfloat16, 1, 16),
    "1head-16w-state_fp32": (torch.float32, 1, 16),
}


@pytest.mark.parametrize("case", SASS_CASES.values(), ids=SASS_CASES.keys())
def test_sm90_compile_without_spills(case):
    """The launch configurations at the Qwen3.5-35B-A3B geometry (bf16 activations, the models'
    layouts) compile for sm_90 offline without register spills (printed with -s)."""
    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    import triton

    state_dtype, heads, num_warps = case
    compiled, heads, num_warps = testing.compile_fused_decode(
        QWEN3_5_35B_A3B, 1, torch.bfloat16, state_dtype, heads, num_warps)
    usage = resource_usage(compiled)
    print(f"triton {triton.__version__} {state_dtype} heads={heads} warps={num_warps}: {usage}")
    assert usage["spill_bytes"] == 0, usage
    if None in case[1:]:  # the rule's: its registers fit the warps' share of the SM
        assert usage["registers"] * num_warps * 32 <= 65536


@interpreter_driver
def test_fused_triton_interpreter():
    """Runs the ``interpreted`` tests below on the CPU, in a subprocess with the interpreter."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", TINY_DECODE.values(), ids=TINY_DECODE.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_fused_decode(geometry, batch, state_dtype):
    """Every geometry and batch with some sequences fresh and some carrying state."""
    check_fused_decode(geometry, *batch, "mixed", torch.float32, state_dtype, TINY_SLOTS,
                       "cpu")


@interpreted
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("has_state", ["fresh", "all"])
def test_interpreted_fused_decode_all_fresh_or_all_carried(has_state, state_dtype):
    check_fused_decode(TINY_GEOMETRIES["gqa3-dk8-dv16"], *TINY_DECODE["b5-pad2"], has_state,
                       torch.float32, state_dtype, TINY_SLOTS, "cpu")


@interpreted
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_fused_decode_contiguous_states(geometry, state_dtype):
    check_fused_decode(geometry, *TINY_DECODE["b5-pad2"], "mixed", torch.float32, state_dtype,
                       TINY_SLOTS, "cpu", contiguous_state=True)


@interpreted
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
def test_interpreted_fused_decode_bf16_activations(state_dtype):
    """bf16 activations: the conv outputs, the recurrence's output and the norm rounded as the
    three references round them (against the reference only: the interpreter's bf16 rounding
    differs from torch's, see ``conv_state_tolerance``)."""
    check_fused_decode(TINY_GEOMETRIES["gqa2-dk16-dv8"], 5, 2, "mixed", torch.bfloat16,
                       state_dtype, TINY_SLOTS, "cpu", against_unfused=False)


@interpreted
@pytest.mark.parametrize("launch", [dict(heads=1, num_warps=1), dict(heads=2, num_warps=2)],
                         ids=["1head", "2heads"])
def test_interpreted_fused_decode_tiles(launch):
    """One value head per tile (a loop over the key head's group) and the whole group."""
    check_fused_decode(TINY_GEOMETRIES["gqa2-dk16-dv8"], 5, 2, "mixed", torch.float32,
                       torch.float32, TINY_SLOTS, "cpu", **launch)


@interpreted
def test_interpreted_fused_opcheck():
    opcheck_fused("cpu", torch.float32)
