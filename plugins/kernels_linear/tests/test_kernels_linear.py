"""The qllm-kernels-linear plugin against ``F.linear`` (the ``linear`` op's reference,
``qllm.ops.linear``), its residual add + RMSNorm against ``qllm.ops.norm.add_rms_norm``
(the ``add_rms_norm`` op's reference: the sum exactly, the norm within a rounding; rows 1, 5
and 200 of 2,048 and 96 features on CUDA, tiny ones interpreted, both weight flavours, strided
rows, ``opcheck``), and the two fused (``add_rms_norm_linear``: the add and norm as
``add_rms_norm``'s, the projection that of its normed rows; fused at 1 to 4 rows, the two ops
beyond and for ``x`` in parts; the PDL bits in a CUDA graph, the SASS, one graph node).

- CUDA (skipped without a GPU): bf16 and fp16 parity at the Qwen3.5-35B-A3B projection shapes
  for 1 to 5 and 16 rows (5 and 16 take ``F.linear``), with and without bias; strided and
  batched ``x``; forced configs at the corners of the sweep's grid; CUDA-graph replay;
  ``torch.compile(fullgraph=True, mode="reduce-overhead")`` against eager; ``opcheck``; with
  programmatic dependent launch (``QLLM_PDL``, the ``pdl`` tests), the same bits as without it
  at those shapes, through a CUDA graph of a decode-like GEMV chain replayed many times, and
  for the residual add + RMSNorm in a replayed CUDA graph.
- CPU: which calls take the GEMV, the launch-config rule and the sweep's candidates, the
  launcher's input checks, the custom op's fake path under ``torch.compile(fullgraph=True)``,
  the plugin's registration, the GEMV's PDL launch, its SASS and the add + RMSNorm's compiled
  for sm_90 with PDL (the grid-dependency-control instructions, and nothing but the GEMV's
  first weight tile read, nothing stored, before the wait) and without (none of them; the
  switch itself: ``tests/test_pdl.py``), and, under the Triton interpreter, parity at
  tiny shapes (every row count, partial row and column tiles, several K steps; with the PDL
  switch on too) and ``opcheck``. The interpreter must be switched on before Triton is
  imported, so ``test_triton_interpreter`` reruns this file's ``interpreted`` tests in a
  subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import json
import operator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("qllm_kernels_linear")

# after the skip above, so the suite runs where the plugin is not installed
from qllm.testing.kernels import (HAS_TRITON, called_ops, cuda, graphs_traced_by,  # noqa: E402
                                  interpreted, interpreter_driver)
from qllm.ops import norm  # noqa: E402
from qllm.testing.pdl import (assert_graph_bits_equal, assert_pdl_sass, force_pdl,  # noqa: E402
                              require_pdl_gpu, sass_summaries)
from qllm.testing.sm90 import on_meta  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm_kernels_linear import ops, plugin  # noqa: E402
from qllm_kernels_linear.configs import (ACC_REGISTERS, MAX_GEMV_ROWS,  # noqa: E402
                                         MIN_PROGRAMS, WARP_COLUMNS, GemvConfig, block_m,
                                         candidates, default_config, serves)
from qllm_kernels_linear.testing import (QWEN3_5_35B_A3B_SHAPES, LinearInputs,  # noqa: E402
                                         chain_layers, gemv_chain, linear_inputs, norm_inputs)

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
ALL_DTYPES = {**HALF, "fp32": torch.float32}

shapes = pytest.mark.parametrize("shape", QWEN3_5_35B_A3B_SHAPES.values(),
                                 ids=QWEN3_5_35B_A3B_SHAPES.keys())
with_bias = pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])


def check_parity(inputs: LinearInputs, config: GemvConfig | None = None) -> None:
    """Through the custom op, or the launcher with a forced config, against ``F.linear`` in
    fp32 on the same (rounded) inputs."""
    from qllm_kernels_linear.triton_gemv import gemv

    x, weight, bias = inputs
    out = ops.linear(*inputs) if config is None else gemv(*inputs, config=config)
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def check_add_rms_norm(device: str, dtype: torch.dtype, rows: int, dim: int,
                       zero_centered: bool, parts: int = 0) -> None:
    """The op on ``x`` whose rows lie apart in memory (a column slice), or on ``x`` in
    ``parts`` (``[T, parts, D]``), and a contiguous residual, against the reference."""
    x, residual, weight = norm_inputs(rows, dim, dtype, device, zero_centered, parts)
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6, zero_centered)
    assert_norm_close(normed, summed, x, residual, weight, zero_centered, device, parts)


def assert_norm_close(normed: torch.Tensor, summed: torch.Tensor, x: torch.Tensor,
                      residual: torch.Tensor, weight: torch.Tensor, zero_centered: bool,
                      device: str, parts: int = 0) -> None:
    """A kernel's ``(normed, summed)`` against ``qllm.ops.norm.add_rms_norm`` on its inputs:
    the sum exactly where the rounding allows, the norm within a rounding."""
    dtype = residual.dtype
    ref_normed, ref_summed = norm.add_rms_norm(x, residual, weight, 1e-6, zero_centered)
    assert normed.dtype == summed.dtype == dtype
    assert normed.shape == summed.shape == residual.shape
    tol = TOLERANCE[dtype]
    if parts > 1:  # fp32 sums of several parts may differ in the order of their additions
        torch.testing.assert_close(summed.float(), ref_summed.float(), atol=tol, rtol=tol)
    elif device == "cuda" or dtype == torch.float32:
        assert torch.equal(summed, ref_summed)
    else:  # the interpreter rounds fp32 to bf16 toward zero, the GPU to nearest
        torch.testing.assert_close(summed.float(), ref_summed.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(normed.float(), ref_normed.float(), atol=tol, rtol=tol)


flavours = pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero-centred"])


def norm_linear_inputs(device: str, dtype: torch.dtype, rows: int, n: int, dim: int,
                       zero_centered: bool, parts: int = 0) -> tuple:
    """``add_rms_norm_linear``'s tensors (``norm_inputs``, then a projection weight ``[n,
    dim]``; ``linear_inputs`` synchronises after both, as a launch with PDL reads the weights
    before its wait)."""
    x, residual, norm_weight = norm_inputs(rows, dim, dtype, device, zero_centered, parts)
    return x, residual, norm_weight, linear_inputs(1, n, dim, dtype, device).weight


def check_add_rms_norm_linear(device: str, dtype: torch.dtype, rows: int, n: int, dim: int,
                              zero_centered: bool, parts: int = 0) -> None:
    """The fused op's three outputs: the add and the norm as ``add_rms_norm``'s
    (``assert_norm_close``), the projection that of its own normed rows by ``F.linear`` in
    fp32."""
    x, residual, norm_weight, weight = norm_linear_inputs(device, dtype, rows, n, dim,
                                                          zero_centered, parts)
    out, normed, summed = ops.add_rms_norm_linear(x, residual, norm_weight, 1e-6,
                                                  zero_centered, weight)
    assert_norm_close(normed, summed, x, residual, norm_weight, zero_centered, device, parts)
    assert out.dtype == dtype and out.shape == (rows, n)
    ref = F.linear(normed.float(), weight.float())
    torch.testing.assert_close(out.float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def opcheck_op(device: str, dtype: torch.dtype) -> None:
    """``torch.library.opcheck`` (schema, fake tensor, AOT dispatch) on both paths of the op,
    with and without bias."""
    for rows in (2, MAX_GEMV_ROWS + 1):
        for bias in (False, True):
            torch.library.opcheck(ops.linear, tuple(linear_inputs(rows, 24, 40, dtype, device,
                                                                  bias)))


# ----------------------------------------------------------------------------- CUDA

@cuda
@with_bias
@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16], ids=lambda m: f"m{m}")
@shapes
def test_parity(shape, rows, dtype, bias):
    inputs = linear_inputs(rows, *shape, dtype, "cuda", bias)
    assert ops.takes_gemv(*inputs) == serves(rows, *shape)
    check_parity(inputs)
    if not serves(rows, *shape):  # the fallback is F.linear itself
        assert torch.equal(ops.linear(*inputs), F.linear(*inputs))


@cuda
@flavours
@pytest.mark.parametrize("dtype", ALL_DTYPES.values(), ids=ALL_DTYPES.keys())
@pytest.mark.parametrize("dim", [2048, 96], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("rows", [1, 5, 200], ids=lambda m: f"m{m}")
def test_add_rms_norm_parity(rows, dim, dtype, zero_centered):
    check_add_rms_norm("cuda", dtype, rows, dim, zero_centered)


@cuda
@pytest.mark.parametrize("parts", [1, 9])
@pytest.mark.parametrize("rows", [1, 200], ids=lambda m: f"m{m}")
def test_add_rms_norm_parts_parity(rows, parts):
    """``x`` as the MoE's per-slot outputs ``[T, k + 1, D]`` (Qwen3.5-35B-A3B: 8 + 1)."""
    check_add_rms_norm("cuda", torch.bfloat16, rows, 2048, True, parts)


@cuda
@flavours
@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 200], ids=lambda m: f"m{m}")
def test_add_rms_norm_linear_parity(rows, dtype, zero_centered):
    """At the MoE router's projection (``moe_input``): fused at 1 to 4 rows, the two ops
    beyond."""
    check_add_rms_norm_linear("cuda", dtype, rows, *QWEN3_5_35B_A3B_SHAPES["moe_input"],
                              zero_centered)


@cuda
@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
def test_strided_and_batched_x(dtype):
    """Rows of ``x`` apart in memory (a column slice), columns apart (stride 2) and leading
    dimensions ``[2, 2, K]``."""
    n, k = QWEN3_5_35B_A3B_SHAPES["out_proj"]
    _, weight, bias = linear_inputs(1, n, k, dtype, "cuda", bias=True)
    wide = torch.randn(4, 2 * k, device="cuda", dtype=dtype)
    for x in (wide[:3, :k], wide[:3, ::2], wide[:, :k].reshape(2, 2, k)):
        out = ops.linear(x, weight, bias)
        ref = F.linear(x.float(), weight.float(), bias.float())
        assert out.shape == (*x.shape[:-1], n)
        torch.testing.assert_close(out.float(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


FORCED = {  # corners of the sweep's grid (and one warp), all within its register filter
    "n1-k512-w2-s1": GemvConfig(1, 512, 2, 1),
    "n2-k1024-w2-s3": GemvConfig(2, 1024, 2, 3),
    "n4-k1024-w4-s2": GemvConfig(4, 1024, 4, 2),
    "n2-k4096-w8-s3": GemvConfig(2, 4096, 8, 3),
    "n4-k256-w1-s2": GemvConfig(4, 256, 1, 2),
}


@cuda
@pytest.mark.parametrize("rows", [1, 3], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("config", FORCED.values(), ids=FORCED.keys())
def test_forced_configs(config, rows):
    """Partial row tiles (N = 264 rows is no multiple of 16) and K steps past the end."""
    for n, k in (QWEN3_5_35B_A3B_SHAPES["moe_input"], (100, 3000)):
        check_parity(linear_inputs(rows, n, k, device="cuda", bias=True), config)


@cuda
def test_cuda_graph_replay():
    """Captured once, replayed after ``x`` changes in place."""
    inputs = linear_inputs(1, *QWEN3_5_35B_A3B_SHAPES["out_proj"], device="cuda")
    ops.linear(*inputs)  # compile the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(*inputs)
    for seed in (1, 2):
        inputs.x.copy_(linear_inputs(1, 1, inputs.x.shape[1], device="cuda", seed=seed).x)
        graph.replay()
        torch.testing.assert_close(out, ops.linear(*inputs), atol=0, rtol=0)


def _projection(x, weight, bias):
    """How a model layer calls the registered kernel, between pointwise ops."""
    return ops.linear(x * 2, weight, bias).relu()


@cuda
def test_compiled_matches_eager():
    """A ``fullgraph`` CUDA-graph compile with a dynamic row count, like the decode step, on
    both paths of the op: the GEMV's output is bit for bit the eager one (cuBLAS's may pick
    another algorithm under graph capture)."""
    compiled = torch.compile(_projection, fullgraph=True, mode="reduce-overhead", dynamic=True)
    n, k = QWEN3_5_35B_A3B_SHAPES["moe_input"]
    for rows in (2, 3, 16):
        inputs = linear_inputs(rows, n, k, device="cuda", bias=True)
        eager = _projection(*inputs)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(*inputs)
        tol = 0 if serves(rows, n, k) else TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out, eager, atol=tol, rtol=tol)


@cuda
def test_opcheck_cuda():
    opcheck_op("cuda", torch.bfloat16)


def _pdl_on(monkeypatch):
    """Switch PDL on for every launch (skips where the GPU cannot launch with it)."""
    from qllm_kernels_linear import triton_gemv

    require_pdl_gpu()
    force_pdl(monkeypatch, True)
    return triton_gemv


@cuda
@pytest.mark.parametrize("case", [(1, False), (1, True), (2, True), (4, False)],
                         ids=["m1", "m1-bias", "m2-bias", "m4"])
@shapes
def test_pdl_parity(shape, case, monkeypatch):
    """With ``QLLM_PDL`` on, the op gives the bits of the launch without PDL: at one row (the
    five projections of a W3 decode step: ``out_proj`` is ``o_proj``'s shape too) and at the
    other row counts the GEMV serves, twice in a row (the second launch overlaps the first)."""
    triton_gemv = _pdl_on(monkeypatch)
    rows, bias = case
    if not serves(rows, *shape):
        pytest.skip("F.linear serves it")
    inputs = linear_inputs(rows, *shape, device="cuda", bias=bias)
    reference = triton_gemv.gemv(*inputs, pdl=False)
    first, second = ops.linear(*inputs), ops.linear(*inputs)
    assert torch.equal(first, reference) and torch.equal(second, reference)


def _graphed(step):
    """``step()`` captured in a CUDA graph (after one warm-up call): its replay and output."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def _replays_match(replay, out, static_input, inputs, references, replays=200):
    """Each of ``replays`` replays, on one of ``inputs`` copied into ``static_input`` (the same
    several replays in a row, too), gives the bits of its reference."""
    for index in range(replays):
        which = (index // 7) % len(inputs)
        static_input.copy_(inputs[which])
        replay()
        assert torch.equal(out, references[which]), f"replay {index}, input {which}"


@cuda
def test_pdl_chain_in_cuda_graph(monkeypatch):
    """A chain of GEMVs as in a decode step (``testing.gemv_chain``, 8 layers: each GEMV fed
    by the one before through elementwise ops; GDN and attention layers) with ``QLLM_PDL``
    on: eagerly, and captured in a CUDA graph replayed 200 times over four inputs, it gives
    the bits of the eager chain without PDL."""
    triton_gemv = _pdl_on(monkeypatch)
    layers = chain_layers(8)
    inputs = [linear_inputs(1, 1, 2048, device="cuda", seed=seed).x for seed in range(4)]
    off = [gemv_chain(x, layers, functools.partial(triton_gemv.gemv, pdl=False))
           for x in inputs]
    for x, reference in zip(inputs, off):
        assert torch.equal(gemv_chain(x, layers, ops.linear), reference)  # eager, PDL
    static_input = inputs[0].clone()
    replay, out = _graphed(lambda: gemv_chain(static_input, layers, ops.linear))
    _replays_match(replay, out, static_input, inputs, off)


@cuda
@pytest.mark.parametrize("parts", [0, 9], ids=["plain", "parts9"])
def test_pdl_add_rms_norm_in_cuda_graph(parts, monkeypatch):
    """The residual add + RMSNorm at one row of 2,048 (after a projection, and summing the
    MoE's nine per-slot outputs) with ``QLLM_PDL`` on, eagerly and in a replayed CUDA graph:
    the bits without PDL."""
    require_pdl_gpu()
    inputs = norm_inputs(1, 2048, torch.bfloat16, "cuda", True, parts)
    assert_graph_bits_equal(lambda: ops.add_rms_norm(*inputs, 1e-6, True), monkeypatch)


@cuda
@pytest.mark.parametrize("rows", [1, 4], ids=lambda m: f"m{m}")
def test_pdl_add_rms_norm_linear_in_cuda_graph(rows, monkeypatch):
    """The add + norm + router projection at one and four rows of 2,048 with ``QLLM_PDL``
    on, eagerly and in a replayed CUDA graph: the bits without PDL."""
    require_pdl_gpu()
    inputs = norm_linear_inputs("cuda", torch.bfloat16, rows,
                                *QWEN3_5_35B_A3B_SHAPES["moe_input"], True)
    x, residual, norm_weight, weight = inputs
    assert_graph_bits_equal(
        lambda: ops.add_rms_norm_linear(x, residual, norm_weight, 1e-6, True, weight),
        monkeypatch)


def _copied_in(x, layer, linear):
    """``in_proj`` then ``out_proj`` of ``layer`` (``testing.ChainLayer``), each GEMV's input
    copied into place right before it (a device-to-device memcpy, no kernel)."""
    hidden = torch.empty_like(x)
    hidden.copy_(x)
    mixed = linear(hidden, layer.in_proj, None)
    part = x.new_empty(1, 4096)
    part.copy_(mixed[:, :4096])
    return linear(part, layer.out_proj, None)


@cuda
def test_pdl_after_memcpy_in_cuda_graph(monkeypatch):
    """GEMVs whose graph predecessor is a memcpy node (no kernel) with ``QLLM_PDL`` on, replayed
    over two inputs: the bits without PDL."""
    triton_gemv = _pdl_on(monkeypatch)
    (layer,) = chain_layers(1)
    inputs = [linear_inputs(1, 1, 2048, device="cuda", seed=seed).x for seed in range(2)]
    off = [_copied_in(x, layer, functools.partial(triton_gemv.gemv, pdl=False)) for x in inputs]
    static_input = inputs[0].clone()
    replay, out = _graphed(lambda: _copied_in(static_input, layer, ops.linear))
    _replays_match(replay, out, static_input, inputs, off, replays=20)


# ----------------------------------------------------------------------------- CPU

def test_which_calls_take_the_gemv():
    _, weight, bias = linear_inputs(1, 6, 8, bias=True)
    for rows in range(MAX_GEMV_ROWS + 2):
        assert ops.takes_gemv(torch.empty(rows, 8), weight.float(), None) == (
            1 <= rows <= MAX_GEMV_ROWS)
    x = torch.empty(2, 2, 8, dtype=torch.bfloat16)
    assert ops.takes_gemv(x, weight, bias) and ops.takes_gemv(x[0, 0], weight, bias)
    assert not ops.takes_gemv(x, weight.t().contiguous().t(), bias)  # strided rows
    assert not ops.takes_gemv(x, weight.half(), None)
    assert not ops.takes_gemv(x, weight, bias.float())


def test_gemv_serves_the_measured_winners():
    """One row always; more only where the H200 measured the GEMV ahead of cuBLAS."""
    shapes = QWEN3_5_35B_A3B_SHAPES
    assert all(serves(1, n, k) for n, k in shapes.values())
    assert serves(2, *shapes["out_proj"]) and not serves(4, *shapes["out_proj"])
    assert serves(2, *shapes["moe_input"]) and serves(4, *shapes["moe_input"])
    assert not any(serves(rows, *shapes[name]) for rows in (2, 4)
                   for name in ("gdn_in_proj", "qkv_proj"))
    assert not serves(MAX_GEMV_ROWS + 1, 6, 8) and not serves(0, 6, 8)


def test_fallback_is_f_linear():
    """Past ``MAX_GEMV_ROWS`` rows, and with no rows, the op is ``F.linear`` (no Triton)."""
    for rows in (0, MAX_GEMV_ROWS + 1):
        inputs = linear_inputs(rows, 6, 8, torch.float32, bias=True)
        assert torch.equal(ops.linear(*inputs), F.linear(*inputs))


def test_launch_config_rule():
    for (n, k) in QWEN3_5_35B_A3B_SHAPES.values():
        for rows in range(1, MAX_GEMV_ROWS + 1):
            config = default_config(rows, n, k)
            warp_columns = WARP_COLUMNS * config.num_warps
            assert config.BLOCK_K % warp_columns == 0  # no layout conversion
            assert -(-n // config.BLOCK_N) >= MIN_PROGRAMS
            accumulator = block_m(rows) * config.BLOCK_N * config.BLOCK_K // (32 * config.num_warps)
            assert accumulator <= ACC_REGISTERS
            assert config in candidates(rows, n, k)  # the sweep compares against it
    assert default_config(1, 2048, 4096) == GemvConfig(2, 4096, 4, 1)  # whole K at one row
    assert default_config(2, 2048, 4096) == GemvConfig(2, 2048, 4, 1)
    assert default_config(1, 264, 2048) == GemvConfig(2, 2048, 4, 1)
    assert default_config(4, 12352, 2048) == GemvConfig(1, 2048, 4, 1)
    assert default_config(1, 3, 40) == GemvConfig(1, 64, 1, 1)  # tiny shapes still launch
    for config in candidates(2, 2048, 4096):
        assert config.BLOCK_K % (WARP_COLUMNS * config.num_warps) == 0


def test_swept_table_is_read_per_gpu_and_shape(tmp_path, monkeypatch):
    from qllm_kernels_linear import swept

    path = tmp_path / "swept_gemv.json"
    monkeypatch.setattr(swept, "TABLE_PATH", path)
    swept.load.cache_clear()
    fastest = GemvConfig(4, 256, 1, 1)
    swept.record("GPU A", 1, 12352, 2048, fastest, 14.05, 17.09)
    swept.record("GPU A", 1, 2048, 4096, GemvConfig(1, 2048, 4, 1), 8.38, None)
    swept.record("GPU A", 1, 12352, 2048, fastest, 13.9, 17.0)  # replaces, keeps others
    document = json.loads(path.read_text())
    assert list(document["devices"]["GPU A"]) == ["1,12352,2048", "1,2048,4096"]
    assert document["devices"]["GPU A"]["1,12352,2048"]["us"] == 13.9
    assert swept.swept_config(1, 12352, 2048, "GPU A") == fastest
    assert swept.swept_config(2, 12352, 2048, "GPU A") is None  # another row count
    assert swept.swept_config(1, 12352, 2048, "GPU B") is None  # another GPU
    assert swept.swept_config(1, 12352, 2048, None) is None  # not a GPU
    monkeypatch.setattr(swept, "SWEPT", False)  # QLLM_GEMV_SWEPT=0
    assert swept.swept_config(1, 12352, 2048, "GPU A") is None
    swept.load.cache_clear()


def test_shipped_swept_table_holds_candidates_of_its_shapes():
    """Each entry of the table the plugin ships is a config the sweep's grid has for its
    shape (the launch's layout rules hold) and was faster than the rule when it was timed."""
    from qllm_kernels_linear import swept

    if not swept.TABLE_PATH.is_file():
        pytest.skip("no sweep table shipped yet")
    for device, entries in json.loads(swept.TABLE_PATH.read_text())["devices"].items():
        for key, entry in entries.items():
            m, n, k = (int(value) for value in key.split(","))
            config = swept.load(device)[key]
            assert config in candidates(m, n, k), (device, key)
            assert entry["rule_us"] is None or entry["us"] <= entry["rule_us"], (device, key)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_gemv_rejects_what_it_does_not_serve():
    from qllm_kernels_linear.triton_gemv import gemv

    x, weight, bias = linear_inputs(MAX_GEMV_ROWS + 1, 6, 8, bias=True)
    with pytest.raises(ValueError, match=f"serves 1 to {MAX_GEMV_ROWS} rows, got 5"):
        gemv(x, weight, bias)
    with pytest.raises(ValueError, match="contiguous weight rows"):
        gemv(x[:1], weight.t().contiguous().t(), bias)
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv(x[:1, :4], weight, bias)
    with pytest.raises(ValueError, match="bias of shape"):
        gemv(x[:1], weight, bias[:5])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_compile_fullgraph_on_fake_path(bias):
    """Dynamo and AOT autograd trace the op into one graph node, with a symbolic row count as
    in the decode step, and the fake gives the output (meta tensors: no kernel runs)."""

    def run(backend):
        compiled = torch.compile(ops.linear, fullgraph=True, dynamic=True, backend=backend)
        for rows in (3, 7):
            inputs = [t if t is None else t.to("meta")
                      for t in linear_inputs(rows, 24, 40, bias=bias)]
            out = compiled(*inputs)
            assert out.device.type == "meta" and out.shape == (rows, 24)
            assert out.dtype == torch.bfloat16

    (graph,) = graphs_traced_by(run)  # one graph for both row counts
    assert called_ops(graph) == [torch.ops.qllm_linear.linear.default]


def test_plugin_registration():
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    for dtype in HALF.values():
        kernels = registry.kernels(torch.device("cuda"), dtype)
        assert kernels.names()["linear"] == ("triton" if HAS_TRITON else "torch")
        if HAS_TRITON:
            assert kernels.linear is ops.linear
    for device, dtype in (("cpu", torch.bfloat16), ("cuda", torch.float32)):
        assert registry.kernels(torch.device(device), dtype).names()["linear"] == "torch"
    for dtype in ALL_DTYPES.values():
        kernels = registry.kernels(torch.device("cuda"), dtype)
        assert kernels.names()["add_rms_norm"] == ("triton" if HAS_TRITON else "torch")
    assert registry.kernels(torch.device("cpu"), torch.bfloat16).names()["add_rms_norm"] \
        == "torch"
    for dtype in HALF.values():
        kernels = registry.kernels(torch.device("cuda"), dtype)
        assert kernels.names()["add_rms_norm_linear"] == ("triton" if HAS_TRITON else "torch")
    assert registry.kernels(torch.device("cuda"),
                            torch.float32).names()["add_rms_norm_linear"] == "torch"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_pdl_launch():
    """With PDL the launch sets ``launch_pdl`` and the kernel's ``USE_PDL``; without, neither
    option exists (the launch of before the switch)."""
    from qllm_kernels_linear import triton_gemv

    x, weight, _ = (t.to("meta") if t is not None else t for t in linear_inputs(1, 24, 40))
    out = torch.empty(1, 24, device="meta")
    config = default_config(1, 24, 40)
    grid, args, options = triton_gemv.gemv_launch(x, weight, None, out, config, pdl=True)
    assert grid == (-(-24 // config.BLOCK_N),) and args["USE_PDL"] is True
    assert options == dict(num_warps=config.num_warps, num_stages=config.num_stages,
                           launch_pdl=True)
    _, args, options = triton_gemv.gemv_launch(x, weight, None, out, config, pdl=False)
    assert args["USE_PDL"] is False and "launch_pdl" not in options


def _gemv_sass(m: int, n: int, k: int, pdl: bool, bias: bool, monkeypatch) -> dict:
    """``qllm.testing.pdl.gdc_summary`` of the GEMV for ``x [m, k]`` through ``weight [n, k]``
    (contiguous, as in the models) at the rule's config, compiled for sm_90 as ``gemv``
    launches it, with or without PDL."""
    from qllm_kernels_linear.triton_gemv import gemv

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    (summary,) = sass_summaries(lambda: gemv(meta(m, k), meta(n, k), meta(n) if bias else None),
                                pdl, monkeypatch)
    return summary


PDL_CASES = {**{f"{name}-m1": (1, *shape) for name, shape in QWEN3_5_35B_A3B_SHAPES.items()},
             "moe_input-m4": (4, *QWEN3_5_35B_A3B_SHAPES["moe_input"]),
             "out_proj-m2": (2, *QWEN3_5_35B_A3B_SHAPES["out_proj"])}


def _hinted(loads: list[str], hint: str) -> list[str]:
    """The loads among ``loads`` (SASS opcodes) carrying the eviction ``hint`` (``EF``: the
    weight's ``evict_first``, ``EL``: ``x``'s ``evict_last``)."""
    return [load for load in loads if hint in load.split(".")]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@with_bias
@pytest.mark.parametrize("case", PDL_CASES.values(), ids=PDL_CASES.keys())
def test_pdl_sass(case, bias, monkeypatch):
    """Compiled for sm_90 with ``USE_PDL``: one ``griddepcontrol.launch_dependents``
    (``PREEXIT``) then one ``griddepcontrol.wait`` (``ACQBULK``), unpredicated, with no branch
    or exit before it (every thread runs it), and before it only the loads of the first
    ``BLOCK_K`` weight columns, all of them (16-byte ``LDG.E.EF``: ``BLOCK_N`` rows x
    ``BLOCK_K / (8 x 32 x num_warps)`` per thread): no load of ``x`` (``evict_last``, after
    it) nor of the bias, no store, no atomic; no spill."""
    m, n, k = case
    summary = _gemv_sass(m, n, k, True, bias, monkeypatch)
    config = default_config(m, n, k)
    first_tile = config.BLOCK_N * config.BLOCK_K // (8 * 32 * config.num_warps)
    weight_loads = _hinted(summary["loads_before_wait"], "EF")
    assert summary == dict(spill_bytes=0, waits=1, launch_dependents=1, wait_unpredicated=True,
                           launch_dependents_first=True, loads_before_wait=weight_loads,
                           stores_before_wait=[], control_before_wait=[],
                           loads_after_wait=summary["loads_after_wait"]), summary
    assert len(weight_loads) == first_tile, summary
    assert len(_hinted(summary["loads_after_wait"], "EL")) >= block_m(m) * config.BLOCK_K // (
        8 * 32 * config.num_warps), summary


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("case", PDL_CASES.values(), ids=PDL_CASES.keys())
def test_no_pdl_sass(case, monkeypatch):
    """Without ``USE_PDL`` the kernel holds no grid-dependency-control instruction."""
    summary = _gemv_sass(*case, False, True, monkeypatch)
    assert summary["waits"] == summary["launch_dependents"] == 0, summary


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("parts", [0, 9], ids=["plain", "parts9"])
def test_pdl_add_rms_norm_sass(parts, monkeypatch):
    """The residual add + RMSNorm compiled for sm_90 as launched at one row of 2,048: with PDL
    it waits after reading its weight, before any other load or store
    (``qllm.testing.pdl.assert_pdl_sass``); without, no grid-dependency-control instruction."""
    from qllm_kernels_linear.triton_norm import add_rms_norm

    x, residual, weight = on_meta(*norm_inputs(1, 2048, torch.bfloat16, "cpu", True, parts))
    assert_pdl_sass(lambda: add_rms_norm(x, residual, weight, 1e-6, True), monkeypatch,
                    reads_before_wait=True)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("rows", [1, 4], ids=lambda m: f"m{m}")
def test_pdl_add_rms_norm_linear_sass(rows, monkeypatch):
    """The fused add + norm + router projection compiled for sm_90 as launched at one and four
    rows: with PDL it waits after reading its weight tile and the norm's weight, before any
    other load or store; without, no grid-dependency-control instruction."""
    from qllm_kernels_linear.triton_gemv import gemv_config
    from qllm_kernels_linear.triton_norm_gemv import add_rms_norm_gemv

    n, k = QWEN3_5_35B_A3B_SHAPES["moe_input"]
    x, residual, norm_weight, weight = on_meta(*norm_linear_inputs("cpu", torch.bfloat16, rows,
                                                                   n, k, True))
    config = gemv_config(rows, n, k, x.device)
    assert_pdl_sass(lambda: add_rms_norm_gemv(x, residual, norm_weight, 1e-6, True, weight,
                                              config), monkeypatch, reads_before_wait=True)


def test_norm_gemv_fuses_whole_k_tiles_of_gemv_rows():
    from qllm_kernels_linear.triton_norm_gemv import fuses

    n, k = QWEN3_5_35B_A3B_SHAPES["moe_input"]
    assert all(fuses(rows, k, default_config(rows, n, k)) for rows in range(1, MAX_GEMV_ROWS + 1))
    assert not fuses(MAX_GEMV_ROWS + 1, k, default_config(1, n, k))
    assert not fuses(1, k, GemvConfig(2, 1024, 2, 1))  # a K loop


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_add_rms_norm_gemv_rejects_what_it_does_not_serve():
    from qllm_kernels_linear.triton_norm_gemv import add_rms_norm_gemv

    x, residual, norm_weight, weight = norm_linear_inputs("cpu", torch.bfloat16, 2, 6, 8, True)
    config = default_config(2, 6, 8)
    with pytest.raises(ValueError, match=r"x and residual \[M, K\]"):
        add_rms_norm_gemv(x[:1], residual, norm_weight, 1e-6, True, weight, config)
    with pytest.raises(ValueError, match="unit last strides"):
        add_rms_norm_gemv(x, residual, norm_weight, 1e-6, True, weight.t().contiguous().t(),
                          config)
    with pytest.raises(ValueError, match="one dtype"):
        add_rms_norm_gemv(x, residual, norm_weight.float(), 1e-6, True, weight, config)
    with pytest.raises(ValueError, match="BLOCK_K >= K"):
        add_rms_norm_gemv(x, residual, norm_weight, 1e-6, True, weight, GemvConfig(2, 4, 1, 1))


def test_add_rms_norm_linear_compiles_to_one_node():
    """Under ``torch.compile(fullgraph=True)`` with a symbolic row count the fused op is one
    graph node whose fake gives its three outputs (meta tensors: no kernel runs)."""

    def run(backend):
        compiled = torch.compile(ops.add_rms_norm_linear, fullgraph=True, dynamic=True,
                                 backend=backend)
        for rows in (3, 7):
            x, residual, norm_weight, weight = on_meta(*norm_linear_inputs(
                "cpu", torch.bfloat16, rows, 24, 40, True))
            out, normed, summed = compiled(x, residual, norm_weight, 1e-6, True, weight)
            assert out.shape == (rows, 24) and normed.shape == summed.shape == (rows, 40)

    (graph,) = graphs_traced_by(run)
    fused = torch.ops.qllm_linear.add_rms_norm_linear.default
    assert called_ops(graph) == [fused] + [operator.getitem] * 3  # the op and its outputs


test_triton_interpreter = interpreter_driver(__file__)


TINY_SHAPES = {"n24-k48": (24, 48), "n7-k40": (7, 40), "n33-k64": (33, 64)}
TINY_CONFIGS = {  # None: the rule's; the others tile rows partially and take several K steps
    "default": None,
    "n4-k16": GemvConfig(4, 16, 1, 1),
    "n2-k32": GemvConfig(2, 32, 1, 2),
}


@interpreted
@with_bias
@pytest.mark.parametrize("dtype", ALL_DTYPES.values(), ids=ALL_DTYPES.keys())
@pytest.mark.parametrize("config", TINY_CONFIGS.values(), ids=TINY_CONFIGS.keys())
@pytest.mark.parametrize("rows", range(1, MAX_GEMV_ROWS + 1), ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", TINY_SHAPES.values(), ids=TINY_SHAPES.keys())
def test_interpreted_parity(shape, rows, config, dtype, bias):
    check_parity(linear_inputs(rows, *shape, dtype, bias=bias), config)


@interpreted
@pytest.mark.parametrize("rows", [1, 3], ids=lambda m: f"m{m}")
def test_interpreted_parity_with_pdl_switched_on(rows, monkeypatch):
    """PDL switched on leaves the op's CPU path as it is: the interpreter runs no inline PTX,
    so the launch keeps PDL off."""
    force_pdl(monkeypatch, True)
    check_parity(linear_inputs(rows, 33, 64, torch.bfloat16, bias=True))


@interpreted
def test_interpreted_strided_and_batched_x():
    _, weight, bias = linear_inputs(1, 7, 40, torch.float16, bias=True)
    wide = torch.randn(4, 96, dtype=torch.float16)
    for x in (wide[:3, :40], wide[:3, ::2][:, :40], wide[:, :40].reshape(2, 2, 40)):
        check_parity(LinearInputs(x, weight, bias))


@interpreted
def test_interpreted_opcheck():
    opcheck_op("cpu", torch.float16)


@interpreted
@flavours
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 40], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("rows", [1, 3], ids=lambda m: f"m{m}")
def test_interpreted_add_rms_norm_parity(rows, dim, dtype, zero_centered):
    check_add_rms_norm("cpu", dtype, rows, dim, zero_centered)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [1, 3])
def test_interpreted_add_rms_norm_parts_parity(parts, dtype):
    check_add_rms_norm("cpu", dtype, 3, 40, True, parts)


@interpreted
def test_interpreted_add_rms_norm_opcheck():
    x, residual = torch.randn(3, 40), torch.randn(3, 40)
    for zero_centered in (False, True):
        torch.library.opcheck(ops.add_rms_norm_rows,
                              (x, residual, torch.randn(40), 1e-6, zero_centered))
    torch.library.opcheck(ops.add_rms_norm_rows,
                          (torch.randn(3, 2, 40), residual, torch.randn(40), 1e-6, True))


@interpreted
@flavours
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", range(1, MAX_GEMV_ROWS + 2), ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", [(24, 48), (7, 40)], ids=["n24-k48", "n7-k40"])
def test_interpreted_add_rms_norm_linear_parity(shape, rows, dtype, zero_centered):
    """Fused at 1 to 4 rows (a partial row tile, K not a power of two), the two ops at 5."""
    check_add_rms_norm_linear("cpu", dtype, rows, *shape, zero_centered)


@interpreted
def test_interpreted_add_rms_norm_linear_in_parts():
    """``x`` in parts (the MoE's per-slot outputs) takes ``add_rms_norm`` then ``linear``."""
    check_add_rms_norm_linear("cpu", torch.float32, 2, 24, 40, True, parts=3)


@interpreted
def test_interpreted_add_rms_norm_linear_opcheck():
    """On the fused kernel (x in one part, 2 rows) and the two ops (x in parts, 5 rows)."""
    for rows, parts in ((2, 0), (2, 3), (MAX_GEMV_ROWS + 1, 0)):
        x, residual, norm_weight, _ = norm_linear_inputs("cpu", torch.float32, rows, 24, 40,
                                                         True, parts)
        x = x.unsqueeze(1) if x.dim() == 2 else x  # the op's [T, S, D]
        torch.library.opcheck(ops.add_rms_norm_linear_rows,
                              (x, residual, norm_weight, 1e-6, True, torch.randn(24, 40)))
