"""The few-row GEMM (``triton_skinny``, 5 to ``MAX_SKINNY_ROWS`` rows of the ``linear`` op)
against ``F.linear`` in fp32 on the same rounded inputs.

- CPU: which calls the op hands it (``takes_skinny``: rows, dtypes, strided weights, the
  ``QLLM_SKINNY_GEMM`` switch), the rule's configs, the launcher's input checks, the kernel
  compiled for sm_90 at W1's shapes (no spill); under the Triton interpreter (fp32 and fp16:
  the interpreter's bf16 dot is wrong on the CPU, bf16 is checked on CUDA), parity at tiny
  shapes with partial row, column and K tiles, K split or not, through the op and with forced
  configs.
- CUDA: bf16 and fp16 parity at Qwen3-0.6B's and Qwen3.5-35B-A3B's projection shapes for 5 to
  64 rows, with and without bias, in a CUDA-graph replay too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("qllm_kernels_linear")

from qllm.testing.kernels import HAS_TRITON, cuda, interpreted, interpreter_driver  # noqa: E402
from qllm_kernels_linear import ops  # noqa: E402
from qllm_kernels_linear.configs import MAX_GEMV_ROWS, MAX_SKINNY_ROWS  # noqa: E402
from qllm_kernels_linear.testing import (QWEN3_0_6B_SHAPES, QWEN3_5_35B_A3B_SHAPES,  # noqa: E402
                                         linear_inputs)

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}
SHAPES = {**{f"qwen3-{name}": shape for name, shape in QWEN3_0_6B_SHAPES.items()},
          **{f"qwen3.5-{name}": shape for name, shape in QWEN3_5_35B_A3B_SHAPES.items()}}


def check(inputs, config=None) -> None:
    from qllm_kernels_linear.triton_skinny import skinny_gemm

    x, weight, bias = inputs
    out = ops.linear(*inputs) if config is None else skinny_gemm(*inputs, config=config)
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == ref.shape
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * max(1.0, ref.abs().max().item()),
                               rtol=tol)


# ----------------------------------------------------------------------------- CPU

def test_which_calls_take_it(monkeypatch):
    weight = torch.empty(24, 40, dtype=torch.bfloat16)
    for rows in range(1, MAX_SKINNY_ROWS + 3):
        x = torch.empty(rows, 40, dtype=torch.bfloat16)
        assert ops.takes_skinny(x, weight, None) == (MAX_GEMV_ROWS < rows <= MAX_SKINNY_ROWS)
    x = torch.empty(2, 4, 40, dtype=torch.bfloat16)  # leading dims count as rows: 8
    assert ops.takes_skinny(x, weight, None)
    assert not ops.takes_skinny(x.float(), weight.float(), None)  # half precision only
    assert not ops.takes_skinny(x, weight.half(), None)
    assert not ops.takes_skinny(x, weight.t().contiguous().t(), None)  # strided rows
    monkeypatch.setattr(ops, "SKINNY", False)
    assert not ops.takes_skinny(x, weight, None)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_rule():
    """64 weight rows per program where that still fills about one program per SM, fewer for
    small N, never under the dot's 16; input rows padded to a power of two from 16."""
    from qllm_kernels_linear.triton_skinny import SkinnyConfig, block_m, default_config

    assert default_config(16, 151936, 1024).BLOCK_N == 64
    assert default_config(16, 6144, 1024).BLOCK_N == 32
    assert default_config(16, 6144, 1024).SPLIT_K == 1
    assert default_config(16, 1024, 3072) == SkinnyConfig(16, 128, 4, 4, SPLIT_K=2)
    assert default_config(8, 24, 40).SPLIT_K == 1  # too few K steps to split
    assert default_config(8, 24, 40).BLOCK_K == 64
    assert [block_m(m) for m in (5, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_input_checks():
    from qllm_kernels_linear.triton_skinny import skinny_gemm

    weight = torch.empty(24, 40)
    with pytest.raises(ValueError, match="serves 1 to"):
        skinny_gemm(torch.empty(MAX_SKINNY_ROWS + 1, 40), weight)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        skinny_gemm(torch.empty(8, 41), weight)
    with pytest.raises(ValueError, match="unit column strides"):
        skinny_gemm(torch.empty(8, 40), torch.empty(40, 24).t())
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(torch.empty(8, 40), weight, torch.empty(23))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("rows", [8, 64])
@pytest.mark.parametrize("name", QWEN3_0_6B_SHAPES)
def test_sm90_no_spill(name, rows):
    """Compiled for sm_90 at the rule's config as the op launches it (with the split-K sum
    where the rule splits): no spill."""
    from qllm.testing.sm90 import (captured_launches, compile_for_sm90, on_meta,
                                   resource_usage, sm90_compiler_missing)
    from qllm_kernels_linear.triton_skinny import skinny_gemm

    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    x, weight, _ = on_meta(*linear_inputs(rows, *QWEN3_0_6B_SHAPES[name], torch.bfloat16,
                                          "cpu", bias=True))
    for launch in captured_launches(lambda: skinny_gemm(x, weight)):  # split K: and the sum
        assert resource_usage(compile_for_sm90(*launch))["spill_bytes"] == 0


test_triton_interpreter = interpreter_driver(__file__)


TINY = {"n24-k48": (24, 48), "n7-k40": (7, 40), "n70-k100": (70, 100)}


@interpreted
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [5, 16, 33], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", TINY.values(), ids=TINY.keys())
def test_interpreted_parity(shape, rows, dtype, bias):
    from qllm_kernels_linear.triton_skinny import SkinnyConfig, skinny_gemm

    inputs = linear_inputs(rows, *shape, dtype, bias=bias)
    check(inputs, SkinnyConfig(16, 16, 1, 1))  # partial row and K tiles, several K steps
    check(inputs, SkinnyConfig(16, 16, 1, 1, SPLIT_K=3))  # K split, the last share short
    out = skinny_gemm(*inputs)  # the rule's
    assert torch.equal(out, skinny_gemm(*inputs, config=None))
    if dtype == torch.float16:  # the op routes half precision here
        check(inputs)


# ----------------------------------------------------------------------------- CUDA

@cuda
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [5, 8, 16, 33, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_parity(shape, rows, dtype, bias):
    inputs = linear_inputs(rows, *shape, dtype, "cuda", bias)
    assert ops.takes_skinny(*inputs)
    check(inputs)


@cuda
def test_graph_replay():
    from qllm_kernels_linear.triton_skinny import skinny_gemm

    x, weight, bias = linear_inputs(16, *QWEN3_0_6B_SHAPES["gate_up_proj"], torch.bfloat16,
                                    "cuda", True)
    expected = skinny_gemm(x, weight, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm(x, weight, bias)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
