"""qllm-kernels-int8's kernels against its plain-torch references (``qllm_kernels_int8.quant``).

- CPU: quantization round trips, the reference ops against the full-precision ops on the
  dequantized weights, the custom ops' fake path under ``torch.compile(fullgraph=True)``, the
  plugin's registrations; under the Triton interpreter (``test_triton_interpreter`` reruns
  the ``interpreted`` tests in a subprocess with ``TRITON_INTERPRET=1``) at tiny shapes: the
  8-bit GEMV, the W8A16 GEMM, the fp8 activation quantization, the fp8 block GEMM and both
  8-bit fused MoEs.
- CUDA (skipped without a GPU): the ops at Qwen3.5-35B-A3B shapes in bf16, and a compiled
  fullgraph call.

The interpreter's fp32 -> e4m3 cast rounds a mantissa of 0b111 up without carrying into the
exponent (it gives half the value), so interpreted checks of the activation quantization
allow exactly that; the fp8 GEMMs are checked there on activations quantized by torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("qllm_kernels_int8")

from qllm.testing.kernels import (HAS_TRITON, called_ops, cuda, graphs_traced_by,  # noqa: E402
                                  interpreted, interpreter_driver, run_interpreted_tests)
from qllm.ops import moe  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm_kernels_int8 import ops, plugin, quant  # noqa: E402
from qllm_kernels_moe.configs import GemmConfig, MoeConfig  # noqa: E402
from qllm_kernels_moe.testing import moe_inputs  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}
BLOCK = (32, 32)  # tiny scale blocks, so the tiny shapes have several (and partial) ones


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * k ** -0.5


def _x(m: int, k: int, dtype, device="cpu", seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype).to(device)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- CPU


def test_int8_round_trip():
    w = _weights(40, 96)
    q, scale = quant.quantize_int8_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and q.abs().max() == 127
    deq = quant.dequantize_int8_rows(q, scale)
    assert ((deq - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    q2, scale2 = quant.quantize_int8_rows(deq)  # quantizing the dequantized is exact
    assert torch.equal(q2, q) and torch.allclose(scale2, scale)


def test_fp8_block_round_trip():
    w = _weights(70, 96)  # 3 x 3 blocks of 32, the last row block partial
    q, scale_inv = quant.quantize_fp8_blocks(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    assert q.float().abs().max() == quant.FP8_MAX
    deq = quant.dequantize_fp8_blocks(q, scale_inv, BLOCK)
    torch.testing.assert_close(deq, w, rtol=2 ** -4, atol=1e-3)
    q2, scale2 = quant.quantize_fp8_blocks(deq, BLOCK)
    assert torch.equal(q2.float(), q.float()) and torch.allclose(scale2, scale_inv)


@pytest.mark.parametrize("bias", [False, True])
def test_reference_ops_compute_on_the_dequantized_weights(bias):
    x, w = _x(5, 96, torch.float32), _weights(40, 96)
    b = torch.randn(40) if bias else None
    q, scale = quant.quantize_int8_rows(w)
    assert torch.equal(quant.linear_w8a16(x, q, scale, b),
                       F.linear(x, quant.dequantize_int8_rows(q, scale), b))
    qf, sf = quant.quantize_fp8_blocks(w, BLOCK)
    assert torch.equal(quant.linear_fp8_block(x, qf, sf, b, *BLOCK),
                       F.linear(x, quant.dequantize_fp8_blocks(qf, sf, BLOCK), b))


def _int8_moe_args(inputs) -> tuple:
    x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2 = inputs
    parts = [quant.quantize_int8_rows(w) for w in (w13, w2, shared_w13, shared_w2)]
    return (x, *parts[0], *parts[1], topk_weights, topk_ids, *parts[2], *parts[3])


def _fp8_moe_args(inputs, block=BLOCK) -> tuple:
    x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2 = inputs
    parts = [quant.quantize_fp8_blocks(w, block) for w in (w13, w2, shared_w13, shared_w2)]
    return (x, *parts[0], *parts[1], topk_weights, topk_ids, *parts[2], *parts[3], *block)


def test_reference_moe_matches_the_core_on_dequantized_weights():
    """Both references give the core's ``fused_moe`` reference's output on the dequantized
    experts, eagerly and on the all-experts path that ``torch.compile`` takes."""
    inputs = moe_inputs(9, 8, 64, 32, 2, torch.float32)
    args = _int8_moe_args(inputs)
    deq = [quant.dequantize_int8_rows(q, s) for q, s in (args[1:3], args[3:5], args[7:9],
                                                         args[9:11])]
    expected = moe.fused_moe(inputs.x, deq[0], deq[1], inputs.topk_weights,
                             inputs.topk_ids, deq[2], deq[3])
    torch.testing.assert_close(quant.fused_moe_w8a16(*args), expected, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(quant.fused_moe_w8a16, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), expected, atol=1e-5, rtol=1e-5)
    args = _fp8_moe_args(inputs)
    deq = [quant.dequantize_fp8_blocks(q, s, BLOCK) for q, s in (args[1:3], args[3:5],
                                                                 args[7:9], args[9:11])]
    expected = moe.fused_moe(inputs.x, deq[0], deq[1], inputs.topk_weights,
                             inputs.topk_ids, deq[2], deq[3])
    torch.testing.assert_close(quant.fused_moe_fp8_block(*args), expected, atol=1e-5,
                               rtol=1e-5)


def test_custom_ops_compile_fullgraph_on_fake_path():
    def layer(x, q, scale, qf, scale_inv):
        return ops.linear_w8a16(x, q, scale, None) + ops.linear_fp8_block(x, qf, scale_inv,
                                                                          None, 32, 32)

    def run(backend):
        compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=backend)
        for rows in (3, 5):
            out = compiled(torch.empty(rows, 64, device="meta"),
                           torch.empty(48, 64, dtype=torch.int8, device="meta"),
                           torch.empty(48, device="meta"),
                           torch.empty(48, 64, dtype=torch.float8_e4m3fn, device="meta"),
                           torch.empty(2, 2, device="meta"))
            assert out.shape == (rows, 48)

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph)[:2] == [torch.ops.qllm_int8.linear_w8a16.default,
                                     torch.ops.qllm_int8.linear_fp8_block.default]


def test_plugin_registration():
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    assert sorted(registry.weight_formats) == ["fp8", "int8"]
    assert registry.weight_formats["fp8"].checkpoint_methods == ("fp8",)
    ops_ = plugin.INT8_OPS + plugin.FP8_OPS
    cuda_names = registry.kernels(torch.device("cuda"), torch.bfloat16).names()
    assert {cuda_names[op] for op in ops_} == {"triton" if HAS_TRITON else "torch"}
    cpu_names = registry.kernels(torch.device("cpu"), torch.float32).names()
    assert {cpu_names[op] for op in ops_} == {"torch"}


# ----------------------------------------------------------------------------- interpreter


@interpreter_driver
def test_triton_interpreter():
    """Runs the ``interpreted`` tests below on the CPU, in a subprocess with the interpreter."""
    run_interpreted_tests(__file__)


def check_w8a16(shape: tuple[int, int, int], dtype: torch.dtype):
    """The W8A16 linear op at ``(m, n, k)``, with bias, against its reference; returns the
    input and the unquantized weight ``(x [m, k], w [n, k])``."""
    m, n, k = shape
    x, w, b = _x(m, k, dtype), _weights(n, k), torch.randn(n).to(dtype)
    q, scale = quant.quantize_int8_rows(w)
    _close(ops.linear_w8a16(x, q, scale, b), quant.linear_w8a16(x.float(), q, scale, b.float()),
           dtype)
    return x, w


GEMV_SHAPES = {"m1-n40-k96": (1, 40, 96), "m3-n33-k64": (3, 33, 64)}
GEMM_SHAPES = {"m9-n70-k96": (9, 70, 96), "m20-n64-k128": (20, 64, 128)}


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", GEMV_SHAPES.values(), ids=GEMV_SHAPES.keys())
def test_interpreted_gemv(shape, dtype):
    """The GEMV (no ``tl.dot``: bf16 runs in the interpreter) through the ops, with bias."""
    x, w = check_w8a16(shape, dtype)
    qf, sf = quant.quantize_fp8_blocks(w, BLOCK)
    _close(ops.linear_fp8_block(x, qf, sf, None, *BLOCK),
           quant.linear_fp8_block(x.float(), qf, sf, None, *BLOCK), dtype)


# The interpreter's tl.dot reads bf16 as raw integers, so the GEMMs use fp16 and fp32.
@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", GEMM_SHAPES.values(), ids=GEMM_SHAPES.keys())
def test_interpreted_w8a16_gemm(shape, dtype):
    check_w8a16(shape, dtype)


def check_group_quant(x: torch.Tensor, interpreter: bool) -> None:
    """The Triton quantization against ``quantize_fp8_groups``: the same scales; the same
    values, except (interpreter) those its cast halves."""
    from qllm_kernels_int8.triton_linear import fp8_group_quant

    q, scale = fp8_group_quant(x, BLOCK[1])
    ref_q, ref_scale = quant.quantize_fp8_groups(x.float(), BLOCK[1])
    torch.testing.assert_close(scale.cpu(), ref_scale.cpu(), atol=0, rtol=1e-6)
    q, ref_q = q.float().cpu(), ref_q.float().cpu()
    differ = q != ref_q
    if interpreter:
        assert torch.equal(q[differ], ref_q[differ] / 2) and differ.float().mean() < 0.05
    else:
        assert not differ.any()


@interpreted
def test_interpreted_fp8_group_quant():
    check_group_quant(_x(20, 80, torch.float32), interpreter=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", GEMM_SHAPES.values(), ids=GEMM_SHAPES.keys())
def test_interpreted_fp8_block_gemm(shape, dtype):
    from qllm_kernels_int8.triton_linear import fp8_block_gemm

    m, n, k = shape
    x, w, b = _x(m, k, dtype), _weights(n, k), torch.randn(n).to(dtype)
    qf, sf = quant.quantize_fp8_blocks(w, BLOCK)
    xq, xs = quant.quantize_fp8_groups(x, BLOCK[1])
    out = fp8_block_gemm(xq, xs, qf, sf, b, BLOCK, dtype)
    _close(out, quant.linear_fp8_w8a8_reference(x.float(), qf, sf, b.float(), *BLOCK), dtype)


# name -> (tokens, experts, top_k, hidden, intermediate, skew)
MOE_CASES = {"t7-e8-k2-h64-i32": (7, 8, 2, 64, 32, 0.0),
             "t33-e6-k2-skewed-i48": (33, 6, 2, 64, 48, 10.0)}
MOE_CONFIG = MoeConfig(16, GemmConfig(16, 32), GemmConfig(32, 16, 2))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_interpreted_moe_int8(case, dtype):
    from qllm_kernels_int8.triton_moe import fused_moe_8bit

    tokens, experts, top_k, hidden, inter, skew = case
    args = _int8_moe_args(moe_inputs(tokens, experts, hidden, inter, top_k, dtype, skew=skew))
    ref = quant.fused_moe_w8a16(args[0].float(), *args[1:5], args[5].float(), *args[6:])
    out = fused_moe_8bit(args[0], args[1:3], args[3:5], args[5], args[6], args[7:9],
                         args[9:11], config=MOE_CONFIG)
    _close(out, ref, dtype)
    _close(ops.fused_moe_w8a16(*args), ref, dtype)  # the op, with the table's config


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_interpreted_moe_fp8(case, dtype):
    """The W8A8 GEMMs on activations quantized by torch (see the module docstring)."""
    from qllm_kernels_int8.triton_moe import fused_moe_8bit

    tokens, experts, top_k, hidden, inter, skew = case
    args = _fp8_moe_args(moe_inputs(tokens, experts, hidden, inter, top_k, dtype, skew=skew))
    ref = quant.fused_moe_fp8_w8a8_reference(*args)
    out = fused_moe_8bit(args[0], args[1:3], args[3:5], args[5], args[6], args[7:9],
                         args[9:11], block=BLOCK, config=MOE_CONFIG,
                         quantize=quant.quantize_fp8_groups)
    _close(out, ref, dtype)


# ----------------------------------------------------------------------------- CUDA

DENSE_SHAPES = {"out_proj": (2048, 4096), "moe_input": (264, 2048),
                "gdn_in_proj": (12352, 2048), "qkv_proj": (9216, 2048)}


@cuda
@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_dense_parity(shape, rows):
    n, k = shape
    x, w = _x(rows, k, torch.bfloat16, "cuda"), _weights(n, k).cuda()
    q, scale = quant.quantize_int8_rows(w)
    _close(ops.linear_w8a16(x, q, scale, None), quant.linear_w8a16(x, q, scale, None),
           torch.bfloat16)
    block = (128, 128)
    qf, sf = quant.quantize_fp8_blocks(w, block)
    expected = (quant.linear_fp8_block(x, qf, sf, None, *block) if rows <= ops.GEMV_MAX_ROWS
                else quant.linear_fp8_w8a8_reference(x, qf, sf, None, *block))
    _close(ops.linear_fp8_block(x, qf, sf, None, *block), expected, torch.bfloat16)


@cuda
def test_group_quant_cuda():
    check_group_quant(_x(200, 2048, torch.bfloat16, "cuda"), interpreter=False)


@cuda
@pytest.mark.parametrize("tokens", [1, 7, 200, 2048], ids=lambda n: f"t{n}")
def test_moe_parity_35b_shape(tokens):
    inputs = moe_inputs(tokens, 256, 2048, 512, 8, device="cuda")
    args = _int8_moe_args(inputs)
    _close(ops.fused_moe_w8a16(*args),
           quant.fused_moe_w8a16(args[0].float(), *args[1:5], args[5].float(), *args[6:]),
           torch.bfloat16)
    if tokens <= 200:  # the slot-by-slot W8A8 reference is slow
        args = _fp8_moe_args(inputs, (128, 128))
        _close(ops.fused_moe_fp8_block(*args), quant.fused_moe_fp8_w8a8_reference(*args),
               torch.bfloat16)


@cuda
def test_compiled_decode_matches_eager():
    def layer(x, *args):
        return ops.fused_moe_w8a16(x, *args)

    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead", dynamic=True)
    for tokens in (16, 48):
        args = _int8_moe_args(moe_inputs(tokens, 64, 512, 256, 4, device="cuda"))
        eager = layer(*args)
        for _ in range(3):
            out = compiled(*args)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
