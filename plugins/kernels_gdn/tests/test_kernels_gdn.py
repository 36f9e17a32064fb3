"""The qllm-kernels-gdn plugin against the plain-torch reference ops (``qllm.ops.gdn``).

- CUDA (skipped without a GPU): bf16 activations with fp32 and bf16 states; causal conv1d
  prefill/update and gated delta rule prefill (Triton recurrent, and fla's chunked kernels
  where fla-core is installed) over varlen batches with lengths 1..1000 (over 64, not multiples
  of 64), with and without initial state; decode at batch 1..256 with slots out of order and
  padding rows in the padding slot, three chained steps; the gated RMSNorm at decode and
  prefill sizes; CUDA-graph replay; reduce-overhead ``torch.compile``; ``opcheck``; with
  programmatic dependent launch (``QLLM_PDL``, the ``pdl`` tests), each decode op and the
  layer's chain of them in a replayed CUDA graph, the bits of PDL off.
- CPU: the custom ops' fake path under ``torch.compile(fullgraph=True)``, the plugin's
  registrations, the decode kernels' SASS compiled for sm_90 with PDL (the wait before any
  store, and before any load but of weights, slots and state) and without (no grid-dependency control), and parity of the plugin's own
  Triton kernels at tiny shapes under the Triton interpreter (fla's autotuned kernels need a GPU
  driver, so they run on CUDA only). The interpreter must be switched on before Triton is
  imported, so ``test_triton_interpreter`` reruns this file's ``interpreted`` tests in a
  subprocess with ``TRITON_INTERPRET=1``.

Every check compares all slots of the state: the batch's slots against the reference, every
other slot (stale data) bit for bit, except the padding slot, whose content is unspecified.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Callable

import pytest
import torch

pytest.importorskip("qllm_kernels_gdn")

# after the skip above, so the suite runs where the plugin is not installed
from qllm.ops import gdn as reference  # noqa: E402
from qllm.ops import norm as norm_reference  # noqa: E402
from qllm.testing.kernels import (HAS_TRITON, called_ops, cuda, graphs_traced_by,  # noqa: E402
                                  interpreted, interpreter_driver)
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.pdl import (assert_graph_bits_equal, assert_pdl_sass,  # noqa: E402
                              require_pdl_gpu)
from qllm.testing.sm90 import on_meta  # noqa: E402
from qllm.batch import ForwardBatch  # noqa: E402
from qllm_kernels_gdn import ops, plugin  # noqa: E402
from qllm_kernels_gdn.testing import (GPU_GEOMETRIES, QWEN3_5_35B_A3B,  # noqa: E402
                                      STATE_DTYPES, TOLERANCE, GDNGeometry, assert_close,
                                      assert_states, conv_inputs, conv_state_tolerance,
                                      gdn_inputs, has_state_flags, norm_inputs, random_batch)



GDN_PREFILL = {"triton": ops.gdn_prefill, "fla": ops.fla_gdn_prefill}
# fla normalises q/k in the activation dtype and solves in tf32 (the Triton kernels: TOLERANCE)
FLA_TOLERANCE = 2e-2
# The kernels take any state strides: the models' layouts (default: conv state channel stride 1,
# SSM state key stride 1) and contiguous ones.
state_layouts = pytest.mark.parametrize("contiguous_state", [False, True],
                                        ids=["model-layout", "contiguous"])

GPU_PREFILL = {
    "len1": [1],
    "len64": [64],
    "len1000": [1000],
    "ragged5": [65, 3, 200, 1, 129],
    "long-mix": [1000, 17, 127, 64, 300],
}
GPU_DECODE = {"b1": (1, 0), "b3-pad1": (3, 1), "b64": (64, 0), "b200-pad8": (200, 8),
              "b256": (256, 0)}  # batch -> (sequences, padding rows)
GPU_SLOTS = 256

TINY_GEOMETRIES = {
    "gqa2-dk16-dv8": GDNGeometry(2, 4, 16, 8),
    "mha-dk16-dv12-k3": GDNGeometry(2, 2, 16, 12, conv_kernel=3),
}
TINY_PREFILL = {"len1": [1], "ragged4": [5, 70, 1, 33]}
TINY_DECODE = {"b1": (1, 0), "b5-pad2": (5, 2)}
TINY_SLOTS = 8


def _tolerance(impl: str, dtype: torch.dtype, state_dtype: torch.dtype) -> float:
    return FLA_TOLERANCE if impl == "fla" else max(TOLERANCE[dtype], TOLERANCE[state_dtype])


# ----------------------------------------------------------------------------- checks

def _qkv_sizes(geometry: GDNGeometry) -> list[int]:
    """The conv channels as the layer splits them: q, k, v."""
    key_dim = geometry.num_k_heads * geometry.head_k_dim
    return [key_dim, key_dim, geometry.num_v_heads * geometry.head_v_dim]


def check_conv_prefill(geometry: GDNGeometry, query_lens: list[int], has_state: str,
                       dtype: torch.dtype, state_dtype: torch.dtype, num_slots: int,
                       device: str, contiguous_state: bool = False) -> None:
    batch = random_batch(query_lens, num_slots, has_state_flags(len(query_lens), has_state),
                         device=device, seed=len(query_lens))
    x = conv_inputs(batch, geometry, num_slots, dtype, state_dtype,
                    contiguous_state=contiguous_state)
    before = x.conv_state.clone()
    ref_state = x.conv_state.clone()
    sizes = _qkv_sizes(geometry)
    refs = reference.causal_conv1d_prefill(x.x, x.weight, ref_state, batch, sizes)
    outs = ops.causal_conv1d_prefill(x.x, x.weight, x.conv_state, batch, sizes)
    assert len(outs) == 3 and all(out.is_contiguous() for out in outs)
    for out, ref in zip(outs, refs):
        assert_close(out, ref, _tolerance("triton", dtype, state_dtype))
    assert_states(x.conv_state, ref_state, before, batch, conv_state_tolerance(state_dtype))


def check_conv_update(geometry: GDNGeometry, num_seqs: int, num_padding: int,
                      dtype: torch.dtype, state_dtype: torch.dtype, num_slots: int,
                      device: str, contiguous_state: bool = False) -> None:
    """Three chained steps, the first with some sequences starting fresh."""
    state = ref_state = before = None
    for step in range(3):
        batch = random_batch([1] * num_seqs, num_slots,
                             has_state_flags(num_seqs, "mixed") if step == 0 else True, num_padding,
                             device=device, seed=num_seqs)
        x = conv_inputs(batch, geometry, num_slots, dtype, state_dtype, seed=step,
                        contiguous_state=contiguous_state)
        if state is None:
            state, ref_state, before = x.conv_state, x.conv_state.clone(), x.conv_state.clone()
        ref = reference.causal_conv1d_update(x.x, x.weight, ref_state, batch)
        out = ops.causal_conv1d_update(x.x, x.weight, state, batch)
        assert_close(out[:num_seqs], ref[:num_seqs], _tolerance("triton", dtype, state_dtype))
        assert_states(state, ref_state, before, batch, conv_state_tolerance(state_dtype))


def check_gdn_prefill(impl: str, geometry: GDNGeometry, query_lens: list[int], has_state: str,
                      dtype: torch.dtype, state_dtype: torch.dtype, num_slots: int,
                      device: str, contiguous_state: bool = False) -> None:
    batch = random_batch(query_lens, num_slots, has_state_flags(len(query_lens), has_state),
                         device=device, seed=len(query_lens))
    x = gdn_inputs(batch, geometry, num_slots, dtype, state_dtype,
                   contiguous_state=contiguous_state)
    before = x.ssm_state.clone()
    ref_state = x.ssm_state.clone()
    ref = reference.gdn_prefill(*dataclasses.replace(x, ssm_state=ref_state).args())
    out = GDN_PREFILL[impl](*x.args())
    tol = _tolerance(impl, dtype, state_dtype)
    assert_close(out, ref, tol)
    assert_states(x.ssm_state, ref_state, before, batch, tol)


def check_gdn_decode(geometry: GDNGeometry, num_seqs: int, num_padding: int,
                     dtype: torch.dtype, state_dtype: torch.dtype, num_slots: int,
                     device: str, contiguous_state: bool = False,
                     gated_norm: bool = False) -> None:
    """Three chained steps, the first with some sequences starting fresh; with
    ``gated_norm``, ``gdn_decode_gated_norm`` (a whole head per program up to
    ``FUSED_NORM_MAX_ROWS`` sequences, two kernels above)."""
    tol = _tolerance("triton", dtype, state_dtype)
    norm, ref_op, op = (), reference.gdn_decode, ops.gdn_decode
    if gated_norm:
        _, gate, norm_weight = norm_inputs(num_seqs + num_padding, geometry.num_v_heads,
                                           geometry.head_v_dim, dtype, device)
        norm = (gate, norm_weight, 1e-6)
        ref_op, op = reference.gdn_decode_gated_norm, ops.gdn_decode_gated_norm
    state = ref_state = before = None
    for step in range(3):
        batch = random_batch([1] * num_seqs, num_slots,
                             has_state_flags(num_seqs, "mixed") if step == 0 else True, num_padding,
                             device=device, seed=num_seqs)
        x = gdn_inputs(batch, geometry, num_slots, dtype, state_dtype, seed=step,
                       contiguous_state=contiguous_state)
        if state is None:
            state, ref_state, before = x.ssm_state, x.ssm_state.clone(), x.ssm_state.clone()
        ref = ref_op(*dataclasses.replace(x, ssm_state=ref_state).args(), *norm)
        out = op(*dataclasses.replace(x, ssm_state=state).args(), *norm)
        assert out.shape == ref.shape and out.dtype == dtype
        assert_close(out[:num_seqs], ref[:num_seqs], tol)
        assert_states(state, ref_state, before, batch, tol)


def _slot_fields(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent-slot tensors the custom ops take: ``slots [B]``, ``has_initial_state
    [B]``."""
    cache = batch.caches["recurrent_slot"]
    return cache.slots, cache.has_initial_state


def opcheck_ops(device: str, dtype: torch.dtype, with_fla: bool) -> None:
    """``torch.library.opcheck`` on the custom ops (schema incl. mutation, fake tensor, AOT
    dispatch)."""
    geometry = TINY_GEOMETRIES["gqa2-dk16-dv8"]
    prefill = random_batch([5, 70, 1], TINY_SLOTS, [True, False, True], device=device)
    decode = random_batch([1] * 3, TINY_SLOTS, [True, False, True], 1, device=device)
    for batch, conv, conv_args in (
            (prefill, ops.conv1d_prefill, lambda b: (b.query_start_loc, *_slot_fields(b),
                                                     b.max_query_len, _qkv_sizes(geometry))),
            (decode, ops.conv1d_update, _slot_fields)):
        x = conv_inputs(batch, geometry, TINY_SLOTS, dtype, torch.float32)
        torch.library.opcheck(conv, (x.x, x.weight, x.conv_state, *conv_args(batch)))
    gdn_ops = [ops.recurrent_prefill] + ([ops.fla_chunk_prefill] if with_fla else [])
    for op in gdn_ops:
        x = gdn_inputs(prefill, geometry, TINY_SLOTS, dtype, torch.float32)
        b = x.batch
        host_lens = (b.query_lens_host,) if op is ops.fla_chunk_prefill else ()
        torch.library.opcheck(op, (*x.args()[:8], b.query_start_loc, *host_lens,
                                   *_slot_fields(b)))
    x = gdn_inputs(decode, geometry, TINY_SLOTS, dtype, torch.float32)
    torch.library.opcheck(ops.recurrent_decode, (*x.args()[:8], *_slot_fields(decode)))
    _, gate, norm_weight = norm_inputs(4, geometry.num_v_heads, geometry.head_v_dim, dtype,
                                       device)
    torch.library.opcheck(ops.recurrent_decode_gated_norm,
                          (*x.args()[:8], *_slot_fields(decode), gate, norm_weight, 1e-6))
    torch.library.opcheck(ops.rms_norm_gated_heads, (*norm_inputs(3, 4, 8, dtype, device),
                                                     1e-6))


def check_rms_norm_gated(tokens: int, heads: int, dim: int, dtype: torch.dtype,
                         device: str) -> None:
    """The gated RMSNorm op against ``qllm.ops.norm`` (which follows transformers' casts)."""
    x, gate, weight = norm_inputs(tokens, heads, dim, dtype, device)
    out = ops.rms_norm_gated(x, gate, weight, 1e-6)
    assert out.is_contiguous()
    assert_close(out, norm_reference.rms_norm_gated(x, gate, weight, 1e-6), TOLERANCE[dtype])


def check_l2norm_heads(tokens: int, heads: int, dim: int, dtype: torch.dtype,
                       device: str) -> None:
    """The prefill's q/k L2 norm on a strided slice of a conv output (as ``fla_chunk`` takes
    q) against ``qllm.ops.gdn.l2norm`` in fp32, rounded once: contiguous, finite on zero
    heads."""
    from qllm_kernels_gdn.triton_l2norm import l2norm_heads

    conv_out = torch.randn(tokens, 3 * heads * dim, dtype=dtype, device=device) * 3
    q = conv_out[:, heads * dim:2 * heads * dim].unflatten(-1, (heads, dim))  # [T, H, D]
    q[0, 0].zero_()
    out = l2norm_heads(q)
    assert out.is_contiguous() and out.dtype == dtype and torch.isfinite(out).all()
    assert_close(out, reference.l2norm(q.float()).to(dtype), TOLERANCE[dtype])


# ----------------------------------------------------------------------------- CUDA

@cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("has_state", ["fresh", "mixed"])
@pytest.mark.parametrize("lens", GPU_PREFILL.values(), ids=GPU_PREFILL.keys())
@pytest.mark.parametrize("geometry", [GPU_GEOMETRIES["qwen3.5-35b"],
                                      GPU_GEOMETRIES["gqa4-dv96-k3"]], ids=["qwen3.5-35b",
                                                                            "gqa4-dv96-k3"])
def test_conv_prefill_parity(geometry, lens, has_state, state_dtype):
    check_conv_prefill(geometry, lens, has_state, torch.bfloat16, state_dtype, GPU_SLOTS, "cuda")


@cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", GPU_DECODE.values(), ids=GPU_DECODE.keys())
@pytest.mark.parametrize("geometry", [GPU_GEOMETRIES["qwen3.5-35b"],
                                      GPU_GEOMETRIES["gqa4-dv96-k3"]], ids=["qwen3.5-35b",
                                                                            "gqa4-dv96-k3"])
def test_conv_update_parity(geometry, batch, state_dtype):
    check_conv_update(geometry, *batch, torch.bfloat16, state_dtype, GPU_SLOTS, "cuda")


@cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("has_state", ["fresh", "mixed"])
@pytest.mark.parametrize("lens", GPU_PREFILL.values(), ids=GPU_PREFILL.keys())
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES.values(), ids=GPU_GEOMETRIES.keys())
@pytest.mark.parametrize("impl", GDN_PREFILL)
def test_gdn_prefill_parity(impl, geometry, lens, has_state, state_dtype, monkeypatch):
    if impl == "fla" and not plugin.HAS_FLA:
        pytest.skip("fla-core is not installed")
    monkeypatch.setattr(ops, "RECURRENT_PREFILL_MAX_TOKENS", 0)  # fla's kernels at every size
    check_gdn_prefill(impl, geometry, lens, has_state, torch.bfloat16, state_dtype, GPU_SLOTS,
                      "cuda")


@cuda
@state_layouts
@pytest.mark.parametrize("gated_norm", [False, True], ids=["plain", "gated_norm"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", GPU_DECODE.values(), ids=GPU_DECODE.keys())
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES.values(), ids=GPU_GEOMETRIES.keys())
def test_gdn_decode_parity(geometry, batch, state_dtype, gated_norm, contiguous_state):
    """``gdn_decode``, and ``gdn_decode_gated_norm`` (whole heads up to 16 sequences, the
    two kernels above)."""
    check_gdn_decode(geometry, *batch, torch.bfloat16, state_dtype, GPU_SLOTS, "cuda",
                     contiguous_state, gated_norm)


# tokens x value heads x value dim: decode at batch 1 and 200, a prefill chunk, dv 96
GPU_NORM = {"t1": (1, 32, 128), "t200": (200, 32, 128), "t4099": (4099, 32, 128),
            "dv96": (37, 8, 96)}


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_NORM.values(), ids=GPU_NORM.keys())
def test_rms_norm_gated_parity(shape, dtype):
    check_rms_norm_gated(*shape, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_NORM.values(), ids=GPU_NORM.keys())
def test_l2norm_heads_parity(shape, dtype):
    check_l2norm_heads(*shape, dtype, "cuda")


def _decode_step(qkv: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                 a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 ssm_state: torch.Tensor, batch: ForwardBatch, kernels=ops) -> torch.Tensor:
    """The GDN layer's decode path from the conv input to the recurrence output
    (``qllm_qwen3_5.deltanet``), through ``kernels`` (``ops`` or the reference)."""
    hv, dk, dv = ssm_state.shape[1:]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    x = kernels.causal_conv1d_update(qkv, weight, conv_state, batch)  # [B, C]
    q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return kernels.gdn_decode(q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)),
                              v.unflatten(-1, (hv, dv)), a, b, A_log, dt_bias, ssm_state,
                              batch)


def _decode_step_inputs(geometry: GDNGeometry, num_seqs: int, num_padding: int,
                        dtype: torch.dtype, num_slots: int, device: str) -> list:
    batch = random_batch([1] * num_seqs, num_slots, has_state_flags(num_seqs, "mixed"), num_padding,
                         device=device, seed=num_seqs)
    conv = conv_inputs(batch, geometry, num_slots, dtype, dtype)
    gdn = gdn_inputs(batch, geometry, num_slots, dtype, torch.float32)
    return [conv.x, conv.weight, conv.conv_state, gdn.a, gdn.b, gdn.A_log, gdn.dt_bias,
            gdn.ssm_state, batch]


def check_compiled_decode_step(args: list, **compile_options) -> None:
    """The compiled decode path (conv update, split, recurrence) gives the eager kernels' output
    and states bit for bit, over warm-up, recording and replay calls."""
    conv_state, ssm_state = args[2], args[7]
    for state in (conv_state, ssm_state):  # as the engine's cache pools: graphs update in place
        torch._dynamo.mark_static_address(state)
    conv0, ssm0 = conv_state.clone(), ssm_state.clone()
    eager = _decode_step(*args)
    conv_eager, ssm_eager = conv_state.clone(), ssm_state.clone()
    compiled = torch.compile(_decode_step, fullgraph=True, **compile_options)
    for _ in range(3):
        conv_state.copy_(conv0)
        ssm_state.copy_(ssm0)
        out = compiled(*args)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    torch.testing.assert_close(conv_state, conv_eager, atol=0, rtol=0)
    torch.testing.assert_close(ssm_state, ssm_eager, atol=0, rtol=0)


@cuda
def test_decode_cuda_graph_replay():
    """Conv update + recurrence captured once, replayed after inputs, slots and state flags
    change in place."""
    args = _decode_step_inputs(QWEN3_5_35B_A3B, 64, 8, torch.bfloat16, GPU_SLOTS, "cuda")
    x, weight, conv_state, a, b, A_log, dt_bias, ssm_state, batch = args
    _decode_step(*args)  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(*args)
    for seed in range(2):
        moved = random_batch([1] * 64, GPU_SLOTS, has_state_flags(64, "mixed")[::-1], 8, device="cuda",
                             seed=100 + seed)
        for field, moved_field in zip(_slot_fields(batch), _slot_fields(moved)):
            field.copy_(moved_field)
        x.normal_()
        a.normal_()
        b.normal_()
        conv_before, ssm_before = conv_state.clone(), ssm_state.clone()
        ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
        ref = _decode_step(x, weight, ref_conv, a, b, A_log, dt_bias, ref_ssm, batch,
                           reference)
        graph.replay()
        tol = TOLERANCE[torch.bfloat16]
        assert_close(out[:64], ref[:64], tol)
        assert_states(ssm_state, ref_ssm, ssm_before, batch, tol)
        assert_states(conv_state, ref_conv, conv_before, batch, 0.0)


@cuda
def test_compiled_decode_matches_eager():
    """``torch.compile(fullgraph=True, mode="reduce-overhead")``: CUDA graphs of the step."""
    check_compiled_decode_step(
        _decode_step_inputs(QWEN3_5_35B_A3B, 16, 0, torch.bfloat16, GPU_SLOTS, "cuda"),
        mode="reduce-overhead")


def _pdl_decode_steps(num_seqs: int) -> tuple[dict, Callable[[], None]]:
    """A GDN layer's decode kernels at Qwen3.5-35B-A3B's geometry for ``num_seqs`` sequences on
    CUDA, as steps (name -> a call returning its outputs and the states it updated): each op
    alone, and the layer's chain (conv update, recurrence, gated RMSNorm, each fed by the one
    before); and the reset that restores those states."""
    args = _decode_step_inputs(QWEN3_5_35B_A3B, num_seqs, 0, torch.bfloat16, GPU_SLOTS, "cuda")
    x, weight, conv_state, *_, ssm_state, batch = args
    gdn = gdn_inputs(batch, QWEN3_5_35B_A3B, GPU_SLOTS, torch.bfloat16, torch.float32, seed=1)
    x_heads, gate, norm_weight = norm_inputs(num_seqs, QWEN3_5_35B_A3B.num_v_heads,
                                             QWEN3_5_35B_A3B.head_v_dim, torch.bfloat16, "cuda")
    states = (conv_state, ssm_state, gdn.ssm_state)
    initial = [state.clone() for state in states]

    def reset() -> None:
        for state, before in zip(states, initial):
            state.copy_(before)

    steps = {
        "conv_update": lambda: (ops.causal_conv1d_update(x, weight, conv_state, batch),
                                conv_state),
        "gdn_decode": lambda: (ops.gdn_decode(*gdn.args()), gdn.ssm_state),
        "rms_norm_gated": lambda: ops.rms_norm_gated(x_heads, gate, norm_weight, 1e-6),
        "layer": lambda: (ops.rms_norm_gated(_decode_step(*args), gate, norm_weight, 1e-6),
                          conv_state, ssm_state),
        "gdn_decode_gated_norm": lambda: (
            ops.gdn_decode_gated_norm(*gdn.args(), gate, norm_weight, 1e-6), gdn.ssm_state),
    }
    return steps, reset


@cuda
@pytest.mark.parametrize("num_seqs", [1, 64], ids=["b1", "b64"])
@pytest.mark.parametrize("step", ["conv_update", "gdn_decode", "rms_norm_gated", "layer",
                                  "gdn_decode_gated_norm"])
def test_pdl_decode_in_cuda_graph(step, num_seqs, monkeypatch):
    """With ``QLLM_PDL`` on, each decode op, and the layer's chain of them, eagerly and in a
    CUDA graph replayed 100 times (the states restored before each), gives the outputs and
    states of PDL off bit for bit."""
    require_pdl_gpu()
    steps, reset = _pdl_decode_steps(num_seqs)
    assert_graph_bits_equal(steps[step], monkeypatch, reset=reset)


@cuda
def test_opcheck_cuda():
    opcheck_ops("cuda", torch.bfloat16, with_fla=plugin.HAS_FLA)


# ----------------------------------------------------------------------------- CPU

def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, ForwardBatch):
        return dataclasses.replace(value, **{f.name: _to_meta(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


FAKE_CASES = {  # registered function, its custom op, the step's query lengths
    "causal_conv1d_prefill": (ops.causal_conv1d_prefill, "conv1d_prefill", [5, 70, 1]),
    "causal_conv1d_update": (ops.causal_conv1d_update, "conv1d_update", [1] * 3),
    "gdn_prefill": (ops.gdn_prefill, "recurrent_prefill", [5, 70, 1]),
    "fla_gdn_prefill": (ops.fla_gdn_prefill, "fla_chunk_prefill", [5, 700, 1]),
    # a short step takes the recurrent kernel where fla is installed too
    "fla_gdn_prefill-short": (ops.fla_gdn_prefill, "recurrent_prefill", [5, 70, 1]),
    "gdn_decode": (ops.gdn_decode, "recurrent_decode", [1] * 3),
    "gdn_decode_gated_norm": (ops.gdn_decode_gated_norm, "recurrent_decode_gated_norm",
                              [1] * 3),
}


@pytest.mark.parametrize("case", FAKE_CASES.values(), ids=FAKE_CASES.keys())
def test_compile_fullgraph_on_fake_path(case):
    """Dynamo and AOT autograd trace the registered functions into one graph holding the
    custom op, and the fake implementation gives the output (meta tensors: no kernel runs)."""
    fn, op_name, query_lens = case
    geometry = TINY_GEOMETRIES["gqa2-dk16-dv8"]
    batch = random_batch(query_lens, TINY_SLOTS, True)
    if op_name.startswith("conv"):
        x = conv_inputs(batch, geometry, TINY_SLOTS, torch.bfloat16, torch.bfloat16)
        args = [x.x, x.weight, x.conv_state, batch]
    else:
        args = list(gdn_inputs(batch, geometry, TINY_SLOTS, torch.bfloat16,
                               torch.float32).args())
    if op_name == "conv1d_prefill":
        args.append(_qkv_sizes(geometry))
    if op_name == "recurrent_decode_gated_norm":  # the gate and the norm's weight and eps
        args += [*norm_inputs(3, geometry.num_v_heads, geometry.head_v_dim, torch.bfloat16,
                              "cpu")[1:], 1e-6]
    args = [_to_meta(arg) for arg in args]
    tokens = args[0].shape[0]
    expected = ([(tokens, size) for size in _qkv_sizes(geometry)] if op_name == "conv1d_prefill"
                else [tuple(args[0].shape)] if op_name == "conv1d_update"
                else [tuple(args[2].shape)])  # x, or v

    def run(backend):
        out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
        outs = out if isinstance(out, (list, tuple)) else [out]
        assert [tuple(o.shape) for o in outs] == expected
        assert all(o.device.type == "meta" and o.dtype == torch.bfloat16 for o in outs)

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph)[0] == getattr(torch.ops.qllm_gdn, op_name).default
    assert all(target is operator.getitem for target in called_ops(graph)[1:])  # its parts


def test_fla_chunk_indices_from_host_lengths():
    """The chunk index built from host lengths is fla's (``prepare_chunk_indices`` from
    ``cu_seqlens``, which syncs on the device): empty sequences own no chunk."""
    from qllm_kernels_gdn.fla_chunk import chunk_indices

    lens = [5, 70, 1, 0, 129]
    expected = [[0, 0], [1, 0], [1, 1], [2, 0], [4, 0], [4, 1], [4, 2]]
    got = chunk_indices(lens, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.tolist() == expected
    assert chunk_indices([], torch.device("cpu")).shape == (0, 2)
    if plugin.HAS_FLA:
        from fla.ops.utils.index import prepare_chunk_indices

        cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)])
        assert prepare_chunk_indices(cu_seqlens, 64).tolist() == expected


def test_plugin_registrations(monkeypatch):
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    triton_ops = ("causal_conv1d_prefill", "causal_conv1d_update", "gdn_decode",
                  "gdn_decode_gated_norm", "rms_norm_gated")
    ops_here = (*triton_ops, "gdn_prefill")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        names = registry.kernels(torch.device("cuda"), dtype).names()
        expected = "triton" if HAS_TRITON else "torch"
        assert {op: names[op] for op in triton_ops} == dict.fromkeys(triton_ops, expected)
        assert names["gdn_prefill"] == ("fla" if plugin.HAS_FLA and HAS_TRITON else expected)
    names = registry.kernels(torch.device("cpu"), torch.bfloat16).names()
    assert {names[op] for op in ops_here} == {"torch"}
    monkeypatch.setattr(plugin, "HAS_FLA", False)
    names = registry.kernels(torch.device("cuda"), torch.bfloat16).names()
    assert names["gdn_prefill"] == ("triton" if HAS_TRITON else "torch")


def _pdl_launch(kernel: str) -> Callable[[], object]:
    """The launch of one of the GDN layer's decode kernels at Qwen3.5-35B-A3B's geometry, one
    sequence, on ``meta`` tensors as the layer lays its inputs out."""
    from qllm_kernels_gdn import triton_conv, triton_norm, triton_recurrent

    batch = random_batch([1], TINY_SLOTS, True)
    slots = on_meta(*_slot_fields(batch))
    if kernel == "conv_update":
        conv = conv_inputs(batch, QWEN3_5_35B_A3B, TINY_SLOTS, torch.bfloat16, torch.bfloat16)
        conv_args = on_meta(conv.x, conv.weight, conv.conv_state)
        return lambda: triton_conv.conv1d_update(*conv_args, *slots)
    norm_args = on_meta(*norm_inputs(1, QWEN3_5_35B_A3B.num_v_heads, QWEN3_5_35B_A3B.head_v_dim,
                                     torch.bfloat16, "cpu"))
    if kernel.startswith("gdn_decode"):  # the engine's fp32 state, or bf16 as W3 runs it
        state_dtype = torch.bfloat16 if kernel.endswith("-bf16") else torch.float32
        gdn = gdn_inputs(batch, QWEN3_5_35B_A3B, TINY_SLOTS, torch.bfloat16, state_dtype)
        gdn_args = on_meta(*gdn.args()[:8])
        norm = dict(norm=(*norm_args[1:], 1e-6)) if "gated_norm" in kernel else {}
        return lambda: triton_recurrent.gated_delta_rule(*gdn_args, *slots, **norm)
    return lambda: triton_norm.rms_norm_gated(*norm_args, 1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("kernel", ["conv_update", "gdn_decode", "rms_norm_gated",
                                    "gdn_decode_gated_norm", "gdn_decode_gated_norm-bf16"])
def test_pdl_sass(kernel, monkeypatch):
    """Each decode kernel compiled for sm_90 as launched: with PDL it waits before any store,
    after reading its parameters (and the conv and the recurrence their slots and state) and
    before reading the previous kernels' outputs (``qllm.testing.pdl.assert_pdl_sass``);
    without, no grid-dependency-control instruction."""
    assert_pdl_sass(_pdl_launch(kernel), monkeypatch, reads_before_wait=True)


test_triton_interpreter = interpreter_driver(__file__)


@interpreted
@state_layouts
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("lens", TINY_PREFILL.values(), ids=TINY_PREFILL.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_conv_prefill(geometry, lens, state_dtype, contiguous_state):
    check_conv_prefill(geometry, lens, "mixed", torch.float32, state_dtype, TINY_SLOTS, "cpu",
                       contiguous_state)


@interpreted
@state_layouts
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", TINY_DECODE.values(), ids=TINY_DECODE.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_conv_update(geometry, batch, state_dtype, contiguous_state):
    check_conv_update(geometry, *batch, torch.float32, state_dtype, TINY_SLOTS, "cpu",
                      contiguous_state)


@interpreted
@state_layouts
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("has_state", ["fresh", "mixed"])
@pytest.mark.parametrize("lens", TINY_PREFILL.values(), ids=TINY_PREFILL.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_gdn_prefill(geometry, lens, has_state, state_dtype, contiguous_state):
    check_gdn_prefill("triton", geometry, lens, has_state, torch.float32, state_dtype,
                      TINY_SLOTS, "cpu", contiguous_state)


@interpreted
@state_layouts
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", TINY_DECODE.values(), ids=TINY_DECODE.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_gdn_decode(geometry, batch, state_dtype, contiguous_state):
    check_gdn_decode(geometry, *batch, torch.float32, state_dtype, TINY_SLOTS, "cpu",
                     contiguous_state)


@interpreted
@state_layouts
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernels"])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES.values(), ids=STATE_DTYPES.keys())
@pytest.mark.parametrize("batch", TINY_DECODE.values(), ids=TINY_DECODE.keys())
@pytest.mark.parametrize("geometry", TINY_GEOMETRIES.values(), ids=TINY_GEOMETRIES.keys())
def test_interpreted_gdn_decode_gated_norm(geometry, batch, state_dtype, fused,
                                           contiguous_state, monkeypatch):
    from qllm_kernels_gdn import triton_recurrent

    if not fused:  # the path of steps over FUSED_NORM_MAX_ROWS sequences
        monkeypatch.setattr(triton_recurrent, "FUSED_NORM_MAX_ROWS", 0)
    check_gdn_decode(geometry, *batch, torch.float32, state_dtype, TINY_SLOTS, "cpu",
                     contiguous_state, gated_norm=True)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_norm_only_in_decode_with_whole_heads():
    """The recurrence applies the gated norm to whole heads of one-token steps only: a
    narrower value block or a varlen prefill is refused before any launch."""
    from qllm_kernels_gdn.triton_recurrent import gated_delta_rule

    geometry = TINY_GEOMETRIES["gqa2-dk16-dv8"]
    batch = random_batch([3, 1], TINY_SLOTS, True)
    x = gdn_inputs(batch, geometry, TINY_SLOTS, torch.float32, torch.float32)
    _, gate, weight = norm_inputs(4, geometry.num_v_heads, geometry.head_v_dim, torch.float32,
                                  "cpu")
    args = (*x.args()[:8], *_slot_fields(batch))
    with pytest.raises(ValueError, match="block_v 4 for dv 8"):
        gated_delta_rule(*args, block_v=4, norm=(gate, weight, 1e-6))
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule(*args, batch.query_start_loc, norm=(gate, weight, 1e-6))


@interpreted
def test_interpreted_gates_at_the_extremes():
    """The kernel's gates against ``gdn_gates`` where softplus switches to the identity
    (``a + dt_bias`` above 20: no decay left) and far below 0 (almost no decay)."""
    geometry = TINY_GEOMETRIES["gqa2-dk16-dv8"]
    batch = random_batch([1] * 4, TINY_SLOTS, True)
    x = gdn_inputs(batch, geometry, TINY_SLOTS, torch.float32, torch.float32)
    x.a.copy_(torch.tensor([25.0, 19.5, -30.0, 0.0])[:, None].expand_as(x.a))
    x.b.mul_(20.0)  # beta saturating at 0 and 1
    ref_state = x.ssm_state.clone()
    ref = reference.gdn_decode(*dataclasses.replace(x, ssm_state=ref_state).args())
    out = ops.gdn_decode(*x.args())
    assert_close(out, ref, TOLERANCE[torch.float32])
    assert_close(x.ssm_state, ref_state, TOLERANCE[torch.float32])


@interpreted
@pytest.mark.parametrize("shape", [(1, 4, 8), (5, 2, 12)], ids=["t1", "t5-d12"])
def test_interpreted_rms_norm_gated(shape):
    check_rms_norm_gated(*shape, torch.float32, "cpu")


@interpreted
@pytest.mark.parametrize("shape", [(1, 4, 8), (5, 2, 12), (40, 3, 16)],
                         ids=["t1", "t5-d12", "t40"])
def test_interpreted_l2norm_heads(shape):
    check_l2norm_heads(*shape, torch.float32, "cpu")


@interpreted
def test_interpreted_opcheck():
    opcheck_ops("cpu", torch.float32, with_fla=False)


@interpreted
def test_interpreted_compiled_decode_step():
    """Inductor on the CPU: functionalised custom ops that update the states in place."""
    check_compiled_decode_step(_decode_step_inputs(TINY_GEOMETRIES["gqa2-dk16-dv8"], 3, 1,
                                                   torch.float32, TINY_SLOTS, "cpu"))
