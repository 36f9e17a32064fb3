"""qllm-kernels-int8's kernels against its plain-torch references (``qllm_kernels_int8.quant``).

- CPU: quantization round trips, the reference ops against the full-precision ops on the
  dequantized weights, the custom ops' fake path under ``torch.compile(fullgraph=True)``, the
  plugin's registrations, the GEMV's and the swap-AB GEMM's launch rules, the arithmetic of
  the int8 -> fp32 / bf16 / fp16 conversions, and (with Triton, no GPU) the inline-PTX
  variants compiled for sm_90, the decode kernels' programmatic dependent launch (``QLLM_PDL``,
  the ``pdl`` tests: the 8-bit GEMV's and slot MoE's grid-dependency-control instructions in
  their sm_90 SASS, int8 and fp8), the swap-AB GEMM's code at W2's 200 rows and the rule's other
  tiles included (by the installed Triton: its MMA retired before the next step writes the
  MMA's registers), the fp8 sorted MoE's MMA at 16- and 64-row blocks; under the Triton
  interpreter (``test_triton_interpreter`` reruns the ``interpreted`` tests in a subprocess
  with ``TRITON_INTERPRET=1``) at tiny shapes: the 8-bit GEMV (through the ops and at
  explicit launch configs), both W8A16 GEMMs (through the op, and the swap-AB one at
  explicit configs, split-K included), the fp8 activation quantization, the fp8 block GEMM,
  both 8-bit fused MoEs on the sorted path and on the slot path.
- CUDA (skipped without a GPU): the ops at Qwen3.5-35B-A3B shapes in bf16 (the GEMV with
  both int8 conversions, the swap-AB GEMM with both, in bf16 and fp16), a compiled
  fullgraph call, and, with ``QLLM_PDL`` on (Hopper), the GEMV, the slot MoE and the GEMV
  feeding it at one token, eagerly and in a replayed CUDA graph: the bits of PDL off.

The interpreter's fp32 -> e4m3 cast rounds a mantissa of 0b111 up without carrying into the
exponent (it gives half the value), so interpreted checks of the activation quantization
allow exactly that; the fp8 GEMMs are checked there on activations quantized by torch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("qllm_kernels_int8")

from qllm.testing.kernels import (HAS_TRITON, INTERPRETING, called_ops, cuda,  # noqa: E402
                                  graphs_traced_by, interpreted, interpreter_driver)
from qllm.ops import moe  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.pdl import (assert_graph_bits_equal, assert_pdl_sass,  # noqa: E402
                              require_pdl_gpu, sass_summaries)
from qllm_kernels_int8 import gemm_configs, gemv_configs, ops, plugin, quant  # noqa: E402
from qllm_kernels_linear.configs import GemvConfig  # noqa: E402
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


def _close_requantized(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The W8A8 MoE against its reference at thousands of tokens: bf16's tolerance for all
    but 1e-4 of the elements, 0.1 for those. The intermediate ``hidden`` is quantized again
    per 128-column group; a summation order other than the CPU's fp32 (the GPU's MMA)
    moves some groups' fp8 codes and scales. The reference itself, its gate and up times
    ``1 + 2^-14`` noise at 2,048 tokens: 50 of 37.7M elements beyond 0.02, at most 0.027;
    at ``2^-11``: 1,457, at most 0.045 (all in the shared expert's slot, weighted 0.5)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    error = (out.float() - ref.float()).abs()
    beyond = error > TOLERANCE[torch.bfloat16] * (1 + ref.float().abs())
    assert beyond.float().mean().item() <= 1e-4, f"{beyond.sum().item()} elements beyond"
    assert error.max().item() <= 0.1, error.max().item()


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
    assert sorted(registry.weight_formats) == ["fp8", "fp8-experts", "int8", "int8-experts"]
    assert registry.weight_formats["fp8"].checkpoint_methods == ("fp8",)
    ops_ = plugin.INT8_OPS + plugin.FP8_OPS
    cuda_names = registry.kernels(torch.device("cuda"), torch.bfloat16).names()
    assert {cuda_names[op] for op in ops_} == {"triton" if HAS_TRITON else "torch"}
    cpu_names = registry.kernels(torch.device("cpu"), torch.float32).names()
    assert {cpu_names[op] for op in ops_} == {"torch"}


# Qwen3.5-35B-A3B's dense projections (hidden 2048), name -> weight [N, K]
DENSE_SHAPES = {"out_proj": (2048, 4096), "moe_input": (264, 2048),
                "gdn_in_proj": (12352, 2048), "qkv_proj": (9216, 2048)}


def check_rule(config: GemvConfig, rows: int, n: int, k: int, programs: int,
               rows_per_column: int = 1):
    """A rule's config is a candidate of the sweep, keeps ``x`` and the weights in one layout
    (``BLOCK_K`` one warp span per warp: a chunk per thread and weight row), reads
    ``STEP_BYTES`` per program and step where K allows, and fills the GPU (``programs``)."""
    assert config in gemv_configs.candidates(rows, n, k, rows_per_column)
    assert config.BLOCK_K == gemv_configs.WARP_COLUMNS * config.num_warps
    step_bytes = config.BLOCK_N * rows_per_column * config.BLOCK_K
    assert step_bytes == gemv_configs.STEP_BYTES or config.BLOCK_K >= k
    assert programs >= gemv_configs.MIN_PROGRAMS or config.BLOCK_N == 1


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_gemv_rule(shape, rows, monkeypatch):
    monkeypatch.setattr(gemv_configs, "SWEPT", False)
    n, k = shape
    config = gemv_configs.default_config(rows, n, k)
    check_rule(config, rows, n, k, -(-n // config.BLOCK_N))


@pytest.mark.parametrize("tokens", [1, 4])
def test_slot_moe_rule(tokens, monkeypatch):
    """Qwen3.5-35B-A3B's experts, 8 routed slots and the shared expert's per token."""
    monkeypatch.setattr(gemv_configs, "SWEPT", False)
    slots = 9 * tokens
    config = gemv_configs.slot_moe_config(slots, 512, 2048)
    assert config.BLOCK_M == 1
    for gemm, (n, k, rows_per_column) in ((config.up, (512, 2048, 2)),
                                         (config.down, (2048, 512, 1))):
        check_rule(GemvConfig(gemm.BLOCK_N, gemm.BLOCK_K, gemm.num_warps, gemm.num_stages),
                   1, n, k, slots * -(-n // gemm.BLOCK_N), rows_per_column)


def test_rule_picks_the_sweeps_fastest_where_measured(monkeypatch):
    """The rule reproduces the sweep's fastest at qkv and the slot MoE's one-token GEMMs
    and four-token down (the shapes where ``SWEPT_*`` and the rule agree)."""
    monkeypatch.setattr(gemv_configs, "SWEPT", False)
    assert gemv_configs.default_config(1, 9216, 2048) == gemv_configs.SWEPT_GEMV[1, 9216, 2048]
    for slots in (9, 36):
        rule = gemv_configs.slot_moe_config(slots, 512, 2048)
        swept = gemv_configs.SWEPT_SLOT_GEMMS
        assert rule.down == gemv_configs.slot_gemm_config(swept[slots, 2048, 512, 1])
    assert gemv_configs.slot_moe_config(9, 512, 2048).up == \
        gemv_configs.slot_gemm_config(gemv_configs.SWEPT_SLOT_GEMMS[9, 512, 2048, 2])


@pytest.mark.parametrize("rows", [5, 16, 64, 200, 512])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_swap_ab_rule(shape, rows):
    """The swap-AB GEMM's config is a candidate of the sweep (so it fits one program's
    registers and shared memory), holds all rows up to 256 in one tile (128-row tiles beyond)
    and splits K only into programs that fit on the H200 at once."""
    n, k = shape
    config = gemm_configs.swap_ab_config(rows, n, k)
    assert config in gemm_configs.swap_ab_candidates(rows, n, k)
    assert config.BLOCK_M >= rows if rows <= 256 else config.BLOCK_M == 128
    assert config.BLOCK_N == 16 * config.num_warps  # 64 weight rows per warpgroup
    programs = gemm_configs.tiles(rows, n, config.BLOCK_M, config.BLOCK_N) * config.SPLIT_K
    assert config.SPLIT_K == 1 or programs <= gemm_configs.H200_SMS


def test_int8_gemm_switch(monkeypatch):
    """The GPU-checked shared-B GEMM by default; ``auto`` takes the swap-AB GEMM where its rule
    holds the rows in one 256-row tile."""
    assert not any(ops.swap_ab_serves(rows) for rows in (5, 200, 512))
    monkeypatch.setattr(ops, "INT8_GEMM", "auto")
    assert [ops.swap_ab_serves(rows) for rows in (5, 64, 128, 129, 200, 256, 257, 512)] == [
        False, False, False, True, True, True, False, False]
    monkeypatch.setattr(ops, "INT8_GEMM", "swap_ab")
    assert ops.swap_ab_serves(5) and ops.swap_ab_serves(512)
    monkeypatch.setattr(ops, "INT8_GEMM", "shared_b")
    assert not ops.swap_ab_serves(200)


def test_swap_ab_rule_at_w2():
    """At W2's 200 rows: one 256-row tile on two warpgroups; ``[2048, 4096]`` (16 tiles) split
    four ways, the wide projections not split."""
    wide = gemm_configs.W8A16GemmConfig(128, 256, 64, 1, 8, 3)
    assert gemm_configs.swap_ab_config(200, 12352, 2048) == wide
    assert gemm_configs.swap_ab_config(200, 9216, 2048) == wide
    assert gemm_configs.swap_ab_config(200, 2048, 4096) == dataclasses.replace(wide, SPLIT_K=4)


def test_int8_magic_conversion_is_exact():
    """Both int8 -> fp32 paths of the GEMV give every int8 value exactly: the interpreter's
    ``bits(q + 0x4B000080) - (2^23 + 128)`` and the PTX's ``prmt`` of ``q ^ 0x80`` into the
    low byte of ``0x4B000000`` (2^23), minus the same."""
    q = torch.arange(-128, 128, dtype=torch.int32)
    generic = (q + 0x4B000080).view(torch.float32) - 8388736.0
    ptx = (((q ^ 0x80) & 0xFF) | 0x4B000000).view(torch.float32) - 8388736.0
    assert torch.equal(generic, q.float()) and torch.equal(ptx, q.float())


def test_int8_half_conversion_is_exact():
    """The swap-AB GEMM's PTX conversion gives every int8 value exactly: bf16, the byte below
    ``0x43`` with bit 7 cleared minus the same with only bit 7 kept; fp16, ``q ^ 0x80`` below
    ``0x64`` minus 1152."""
    q = torch.arange(-128, 128, dtype=torch.int32)
    byte = q & 0xFF

    def half(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return bits.to(torch.int16).view(dtype).float()

    word = 0x4300 | byte
    bf16 = half(word & 0xFF7F, torch.bfloat16) - half(word & 0xFF80, torch.bfloat16)
    fp16 = half(0x6400 | (byte ^ 0x80), torch.float16) - half(torch.tensor(0x6480), torch.float16)
    assert torch.equal(bf16, q.float()) and torch.equal(fp16, q.float())


# (kernel, signature, constexprs, options) of each kernel with the inline-PTX int8 conversion
def _fast_int8_launches():
    from qllm_kernels_int8 import triton_gemv, triton_slot_moe, triton_w8a16

    common = dict(SCALE_BLOCK_K=0, FAST_INT8=True, BLOCK_K=2048, NUM_STAGES=1)
    weights = dict(w_ptr="*i8", shared_w_ptr="*i8", scale_ptr="*fp32",
                   shared_scale_ptr="*fp32", ids_ptr="*i64")
    return [
        (triton_gemv._gemv_kernel,
         dict(x_ptr="*bf16", w_ptr="*i8", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16"),
         dict(common, HAS_BIAS=True, BLOCK_M=1, BLOCK_N=8), 4),
        (triton_slot_moe._slot_gate_up_kernel, dict(weights, x_ptr="*bf16", hidden_ptr="*bf16"),
         dict(common, TOP_K=9, BLOCK_N=4), 4),
        (triton_slot_moe._slot_down_kernel,
         dict(weights, hidden_ptr="*bf16", routing_weights_ptr="*bf16", out_ptr="*bf16"),
         dict(common, BLOCK_K=512, BLOCK_N=8), 1),
        *[(triton_w8a16._swap_ab_kernel,
           dict(x_ptr=f"*{dtype}", w_ptr="*i8", scale_ptr="*fp32", bias_ptr=f"*{dtype}",
                out_ptr=f"*{dtype}"),
           dict(HAS_BIAS=True, FAST_INT8=True, SYNC_MMA=True, BLOCK_N=64, BLOCK_M=16,
                BLOCK_K=128), 4)
          for dtype in ("bf16", "fp16")],
    ]


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING, reason="needs triton, compiling")
def test_fast_int8_kernels_compile_for_sm90():
    """The interpreter cannot run inline PTX, so the interpreted tests run the elementwise
    int8 conversion: the PTX variants must at least compile for the GPU, and convert with
    ``prmt`` (no ``I2F``: no int -> float ``cvt``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, pointers, constexprs, warps in _fast_int8_launches():
        signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32")
                     for name in kernel.arg_names}
        compiled = triton.compile(
            ASTSource(kernel, signature, {(kernel.arg_names.index(name),): value
                                          for name, value in constexprs.items()}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = compiled.asm["ptx"]
        assert "prmt.b32" in ptx and "cvt.rn.f32.s" not in ptx, kernel.__name__


def _swap_ab_sass(rows: int, n: int, k: int, fast_int8: bool = True) -> dict:
    """The swap-AB GEMM's code summary, compiled for sm_90 by the installed Triton (skips
    where that Triton lacks what ``qllm.testing.sm90.compile_for_sm90`` uses)."""
    from qllm.testing.sm90 import sm90_compiler_missing
    from qllm_kernels_int8 import testing

    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    return testing.sass_summary(testing.compile_swap_ab(rows, n, k, fast_int8=fast_int8))


def _assert_mma_retired_each_step(summary: dict) -> None:
    """The K loop's ``wgmma`` reads the converted weights from registers, no shared-memory
    store of them, no ``I2F``, no spill; and no MMA is in flight when the next step writes its
    A registers: the loop waits for zero MMA groups, and writes no register that an MMA still
    in flight reads (``testing.in_flight_a_writes``, which the pipeliner's own waits of Triton
    3.6 and 3.7 both fail: the conversion of the next tile lands in them)."""
    import triton

    opcodes = summary["loop_opcodes"]
    where = f"triton {triton.__version__}: {summary}"
    assert summary["spill_bytes"] == 0 and summary["mma_a_in_registers"], where
    assert summary["wgmma_in_flight"] == 0 and summary["a_written_in_flight"] == 0, where
    assert "I2F" not in opcodes and "STS" not in opcodes and "STL" not in opcodes, where


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("shape", [(12352, 2048), (2048, 4096)], ids=["in_proj", "out_proj"])
def test_swap_ab_gemm_sass_at_w2(shape):
    """The swap-AB GEMM at 200 rows, compiled for sm_90 as launched (the rule's config; the
    out_proj split writes fp32 partial sums): ``HGMMA.64x256x16`` (a warpgroup's 64 weight
    rows by the 256-row tile of ``x``), retired each step (``_assert_mma_retired_each_step``)."""
    summary = _swap_ab_sass(200, *shape)
    assert summary["mma"].startswith("HGMMA.64x256x16"), summary
    _assert_mma_retired_each_step(summary)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("fast_int8", [True, False], ids=["ptx", "cast"])
@pytest.mark.parametrize("rows", [5, 64, 512])
def test_swap_ab_gemm_sass_retires_mma(rows, fast_int8):
    """The same at the rule's other tiles (16 and 64 input rows on one warpgroup with 256- and
    128-column steps, 128 rows on two) and with Triton's int8 cast as well (bf16)."""
    _assert_mma_retired_each_step(_swap_ab_sass(rows, 12352, 2048, fast_int8))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("block_m", [16, 64])
def test_sorted_moe_fp8_sass(block_m):
    """The fp8 sorted MoE's down GEMM at W2's 200 tokens (the bf16 table's tiles), compiled
    for sm_90: the fp8 ``wgmma`` (``QGMMA``, e4m3 operands as loaded, no conversion) takes
    64-row blocks; at the table's 16 the tiles are unpacked to fp16 (``F2FP``) for
    ``mma.sync`` (``HMMA``). See ``benchmarks/sass_moe.py``."""
    from qllm.testing.sm90 import sm90_compiler_missing
    from qllm_kernels_int8 import testing

    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    config = GemmConfig(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    summary = testing.sass_summary(testing.compile_sorted_moe(200, False, block_m, config,
                                                              (128, 128)))
    opcodes = summary["loop_opcodes"]
    assert summary["spill_bytes"] == 0, summary
    if block_m == 16:
        assert summary["mma"].startswith("HMMA") and opcodes.get("F2FP"), summary
    else:
        assert summary["mma"].startswith("QGMMA") and "F2FP" not in opcodes, summary


# ----------------------------------------------------------------------------- interpreter


PDL_FORMATS = {"int8": None, "fp8": (128, 128)}  # format -> its scale block (int8: none)
PDL_GEMV_CASES = {**{f"{name}-m1": (1, *shape) for name, shape in DENSE_SHAPES.items()},
                  "out_proj-m4": (4, *DENSE_SHAPES["out_proj"])}


def _meta_8bit(fmt: str, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta`` 8-bit weights ``[..., R, C]`` of ``fmt`` and their scales (int8: ``[..., R]``;
    fp8: ``[..., R / bn, C / bk]``)."""
    block, (*lead, rows, cols) = PDL_FORMATS[fmt], shape
    if block is None:
        return (torch.empty(shape, dtype=torch.int8, device="meta"),
                torch.empty(*lead, rows, device="meta"))
    return (torch.empty(shape, dtype=quant.FP8_DTYPE, device="meta"),
            torch.empty(*lead, -(-rows // block[0]), -(-cols // block[1]), device="meta"))


def _hinted(loads: list[str], hint: str) -> list[str]:
    """The loads among ``loads`` (SASS opcodes) with the eviction ``hint`` (``EF``: weights,
    ``EL``: ``x``)."""
    return [load for load in loads if hint in load.split(".")]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fmt", PDL_FORMATS)
@pytest.mark.parametrize("case", PDL_GEMV_CASES.values(), ids=PDL_GEMV_CASES.keys())
def test_gemv_pdl_sass(case, fmt, bias, monkeypatch):
    """The 8-bit GEMV compiled for sm_90 as launched (inline-PTX int8 conversion), with
    ``USE_PDL``: one ``griddepcontrol.launch_dependents`` (``PREEXIT``) then one unpredicated
    ``griddepcontrol.wait`` (``ACQBULK``), no branch, exit, store or atomic before it, and
    before it only the first step's weight tile, all of it (8-byte ``LDG.E.EF``: ``BLOCK_N``
    rows x ``BLOCK_K / (8 x 32 x num_warps)`` chunks per thread), and its scales (no hint):
    ``x`` (``evict_last``) loads after it; no spill. Without, neither instruction."""
    from qllm_kernels_int8.triton_gemv import gemv_8bit

    m, n, k = case
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    b = torch.empty(n, dtype=torch.bfloat16, device="meta") if bias else None

    def launch():
        return gemv_8bit(x, *_meta_8bit(fmt, n, k), b, PDL_FORMATS[fmt], fast_int8=True)

    (summary,) = sass_summaries(launch, True, monkeypatch)
    before = summary["loads_before_wait"]
    assert summary == dict(spill_bytes=0, waits=1, launch_dependents=1, wait_unpredicated=True,
                           launch_dependents_first=True, loads_before_wait=before,
                           stores_before_wait=[], control_before_wait=[],
                           loads_after_wait=summary["loads_after_wait"]), summary
    config = gemv_configs.default_config(m, n, k)
    chunks = config.BLOCK_K // (gemv_configs.VECTOR * 32 * config.num_warps)
    assert len(_hinted(before, "EF")) == config.BLOCK_N * chunks, summary
    assert not _hinted(before, "EL") and len(_hinted(before, "EF")) < len(before), summary
    assert len(_hinted(summary["loads_after_wait"], "EL")) >= m * chunks, summary
    (summary,) = sass_summaries(launch, False, monkeypatch)
    assert summary["waits"] == summary["launch_dependents"] == 0, summary


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("fmt", PDL_FORMATS)
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_slot_moe_pdl_sass(gemm, fmt, monkeypatch):
    """The slot MoE's gate-up and down kernels at one token of Qwen3.5-35B-A3B (9 slots),
    compiled for sm_90 as launched: with PDL the gate-up waits at entry, before any load or
    store, and lets the down launch after its wait; the down reads its ids and first weights
    before its wait (``qllm.testing.pdl.assert_pdl_sass``); without, no
    grid-dependency-control instruction."""
    from qllm_kernels_int8.triton_slot_moe import slot_down_8bit, slot_gate_up_8bit

    experts, hidden, inter, slots = 256, 2048, 512, 9
    config, block = gemv_configs.slot_moe_config(slots, inter, hidden), PDL_FORMATS[fmt]
    ids = torch.empty(1, slots, dtype=torch.int64, device="meta")
    if gemm == "gate_up":
        op, tiles = slot_gate_up_8bit, config.up
        args = (torch.empty(1, hidden, dtype=torch.bfloat16, device="meta"),
                _meta_8bit(fmt, experts, 2 * inter, hidden), _meta_8bit(fmt, 2 * inter, hidden),
                ids)
    else:
        op, tiles = slot_down_8bit, config.down
        args = (torch.empty(slots, inter, dtype=torch.bfloat16, device="meta"),
                _meta_8bit(fmt, experts, hidden, inter), _meta_8bit(fmt, hidden, inter),
                torch.empty(1, slots, dtype=torch.bfloat16, device="meta"), ids)
    assert_pdl_sass(lambda: op(*args, tiles, block, fast_int8=True), monkeypatch,
                    reads_before_wait=gemm == "down",
                    releases_after_wait={"_slot_gate_up_kernel"})


test_triton_interpreter = interpreter_driver(__file__)


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


# (m, n, k, config): several K steps with a partial last one, rows past N, 2-4 input rows
GEMV_CONFIGS = {"m1-n40-k1000-bk256": (1, 40, 1000, GemvConfig(8, 256, 1, 1)),
                "m2-n33-k200-bk64": (2, 33, 200, GemvConfig(4, 64, 1, 2)),
                "m4-n20-k96-bk16": (4, 20, 96, GemvConfig(2, 16, 1, 1))}


@interpreted
@pytest.mark.parametrize("fp8_block", [None, (32, 32), (4, 16)], ids=["int8", "fp8-32x32",
                                                                        "fp8-4x16"])
@pytest.mark.parametrize("case", GEMV_CONFIGS.values(), ids=GEMV_CONFIGS.keys())
def test_interpreted_gemv_configs(case, fp8_block):
    """The GEMV at explicit launch configs against the references, with bias: fp8 scale
    blocks wider and narrower than a loop step and than a program's rows."""
    from qllm_kernels_int8.triton_gemv import gemv_8bit

    m, n, k, config = case
    x, w, b = _x(m, k, torch.float32), _weights(n, k), torch.randn(n)
    if fp8_block is None:
        q, scale = quant.quantize_int8_rows(w)
        expected = quant.linear_w8a16(x, q, scale, b)
    else:
        q, scale = quant.quantize_fp8_blocks(w, fp8_block)
        expected = quant.linear_fp8_block(x, q, scale, b, *fp8_block)
    _close(gemv_8bit(x, q, scale, b, fp8_block, config), expected, torch.float32)


# The interpreter's tl.dot reads bf16 as raw integers, so the GEMMs use fp16 and fp32.
@interpreted
@pytest.mark.parametrize("gemm", ["swap_ab", "shared_b"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", GEMM_SHAPES.values(), ids=GEMM_SHAPES.keys())
def test_interpreted_w8a16_gemm(shape, dtype, gemm, monkeypatch):
    """Each W8A16 GEMM through the op (``INT8_GEMM`` switched), at its rule's config."""
    monkeypatch.setattr(ops, "INT8_GEMM", gemm)
    check_w8a16(shape, dtype)


# (m, n, k, config): several K steps with a partial last one, rows of x past M and weight rows
# past N in the last tiles, K split 2, 3 (a shorter last split) and 4 ways (an empty split)
SWAP_AB_CONFIGS = {
    "m20-n70-k200-bk32": (20, 70, 200, gemm_configs.W8A16GemmConfig(64, 16, 32, 1, 4, 2)),
    "m40-n130-k96-split2": (40, 130, 96, gemm_configs.W8A16GemmConfig(64, 32, 16, 2, 4, 3)),
    "m20-n70-k200-split3": (20, 70, 200, gemm_configs.W8A16GemmConfig(64, 16, 32, 3, 4, 2)),
    "m5-n130-k96-split4": (5, 130, 96, gemm_configs.W8A16GemmConfig(128, 16, 32, 4, 8, 2)),
}


@interpreted
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", SWAP_AB_CONFIGS.values(), ids=SWAP_AB_CONFIGS.keys())
def test_interpreted_swap_ab_configs(case, dtype, bias):
    """The swap-AB GEMM at explicit configs against the reference."""
    from qllm_kernels_int8.triton_w8a16 import w8a16_gemm_swap_ab

    m, n, k, config = case
    x, w = _x(m, k, dtype), _weights(n, k)
    b = torch.randn(n).to(dtype) if bias else None
    q, scale = quant.quantize_int8_rows(w)
    expected = quant.linear_w8a16(x.float(), q, scale, None if b is None else b.float())
    _close(w8a16_gemm_swap_ab(x, q, scale, b, config), expected, dtype)


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


# name -> (tokens, experts, top_k, hidden, intermediate): the slot path's token counts
SLOT_CASES = {"t1-e8-k2-h64-i32": (1, 8, 2, 64, 32), "t3-e6-k2-h96-i48": (3, 6, 2, 96, 48)}
SLOT_CONFIG = MoeConfig(1, GemmConfig(4, 32, num_warps=1, num_stages=1),
                        GemmConfig(8, 16, num_warps=1, num_stages=1))


@interpreted
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", SLOT_CASES.values(), ids=SLOT_CASES.keys())
def test_interpreted_moe_slot_path(case, dtype, fmt):
    """The 8-bit slot path (no ``tl.dot``: bf16 runs in the interpreter) at an explicit config
    with several K steps and through the op (the rule's config), against the weight-only
    references: every token's slots, the shared expert's included."""
    from qllm_kernels_int8.triton_moe import fused_moe_8bit, moe_config

    tokens, experts, top_k, hidden, inter = case
    inputs = moe_inputs(tokens, experts, hidden, inter, top_k, dtype)
    if fmt == "int8":
        args, block, reference, op = (_int8_moe_args(inputs), None, quant.fused_moe_w8a16,
                                      ops.fused_moe_w8a16)
    else:
        args, block, reference, op = (_fp8_moe_args(inputs), BLOCK, quant.fused_moe_fp8_block,
                                      ops.fused_moe_fp8_block)
    assert moe_config(tokens, experts, 2 * inter, hidden, top_k + 1).BLOCK_M == 1
    ref = reference(args[0].float(), *args[1:5], args[5].float(), *args[6:])
    out = fused_moe_8bit(args[0], args[1:3], args[3:5], args[5], args[6], args[7:9],
                         args[9:11], block=block, config=SLOT_CONFIG)
    _close(out, ref, dtype)
    _close(op(*args), ref, dtype)


# ----------------------------------------------------------------------------- CUDA


@cuda
@pytest.mark.parametrize("fast_int8", [True, False], ids=["ptx", "elementwise"])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_gemv_parity(shape, rows, fast_int8):
    """The int8 GEMV with either int8 conversion, and an odd K (rows not 8-byte aligned)."""
    from qllm_kernels_int8.triton_gemv import gemv_8bit

    for n, k in (shape, (shape[0], shape[1] - 3)):
        x, w = _x(rows, k, torch.bfloat16, "cuda"), _weights(n, k).cuda()
        q, scale = quant.quantize_int8_rows(w)
        _close(gemv_8bit(x, q, scale, None, fast_int8=fast_int8),
               quant.linear_w8a16(x, q, scale, None), torch.bfloat16)


# (activation dtype, inline-PTX int8 conversion) of the swap-AB parity runs
SWAP_AB_VARIANTS = {"bf16-ptx": (torch.bfloat16, True), "bf16-cast": (torch.bfloat16, False),
                    "fp16-ptx": (torch.float16, True)}


@cuda
@pytest.mark.parametrize("variant", SWAP_AB_VARIANTS.values(), ids=SWAP_AB_VARIANTS.keys())
@pytest.mark.parametrize("rows", [5, 64, 200, 512])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_swap_ab_parity(shape, rows, variant):
    """The swap-AB GEMM at the rule's configs, with bias; bf16 through the PTX also at an odd
    K (rows not 16-byte aligned, a partial last K step). Against the reference in fp32: in
    bf16 it rounds every dequantized weight, and at 200 rows of out_proj it strays further
    (0.054 at an output of 4.7) than the kernel (0.016, half a bf16 step there)."""
    from qllm_kernels_int8.triton_w8a16 import w8a16_gemm_swap_ab

    dtype, fast_int8 = variant
    odd_k = variant == SWAP_AB_VARIANTS["bf16-ptx"]
    for n, k in [shape, (shape[0], shape[1] - 3)] if odd_k else [shape]:
        x, w = _x(rows, k, dtype, "cuda"), _weights(n, k).cuda()
        b = torch.randn(n, device="cuda").to(dtype)
        q, scale = quant.quantize_int8_rows(w)
        _close(w8a16_gemm_swap_ab(x, q, scale, b, fast_int8=fast_int8),
               quant.linear_w8a16(x.float(), q, scale, b.float()), dtype)


@cuda
@pytest.mark.parametrize("rows", [64, 200, 512])
@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
def test_swap_ab_is_deterministic(shape, rows):
    """A race between in-flight MMAs and the next tile's conversion shows as outputs that
    change from run to run: 50 runs on the same inputs are bit-identical."""
    from qllm_kernels_int8.triton_w8a16 import w8a16_gemm_swap_ab

    n, k = shape
    x, w = _x(rows, k, torch.bfloat16, "cuda"), _weights(n, k).cuda()
    q, scale = quant.quantize_int8_rows(w)
    first = w8a16_gemm_swap_ab(x, q, scale, None)
    for _ in range(50):
        assert torch.equal(w8a16_gemm_swap_ab(x, q, scale, None), first)


@cuda
@pytest.mark.parametrize("rows", [1, 3, 64, 200, 1000])
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
@pytest.mark.parametrize("tokens", [1, 4, 7, 200, 2048], ids=lambda n: f"t{n}")
def test_moe_parity_35b_shape(tokens):
    """Both formats; fp8 is weight-only on the slot path (1 and 4 tokens), W8A8 beyond."""
    from qllm_kernels_int8.triton_moe import moe_config

    inputs = moe_inputs(tokens, 256, 2048, 512, 8, device="cuda")
    args = _int8_moe_args(inputs)
    _close(ops.fused_moe_w8a16(*args),
           quant.fused_moe_w8a16(args[0].float(), *args[1:5], args[5].float(), *args[6:]),
           torch.bfloat16)
    if tokens <= 200:  # the slot-by-slot W8A8 reference is slow
        args = _fp8_moe_args(inputs, (128, 128))
        if moe_config(tokens, 256, 1024, 2048, 9).BLOCK_M == 1:
            expected = quant.fused_moe_fp8_block(args[0].float(), *args[1:5],
                                                 args[5].float(), *args[6:])
        else:
            expected = quant.fused_moe_fp8_w8a8_reference(*args)
        _close(ops.fused_moe_fp8_block(*args), expected, torch.bfloat16)


@cuda
@pytest.mark.parametrize("fmt", PDL_FORMATS)
@pytest.mark.parametrize("step", ["gemv", "slot_moe", "gemv+slot_moe"])
def test_pdl_decode_in_cuda_graph(step, fmt, monkeypatch):
    """With ``QLLM_PDL`` on, at one token of Qwen3.5-35B-A3B: the 8-bit GEMV (a 2,048 x 2,048
    projection), the slot MoE (gate-up then down) and the GEMV feeding the MoE, eagerly and in
    a CUDA graph replayed 100 times, give the bits of PDL off."""
    from qllm_kernels_int8.triton_moe import moe_config

    require_pdl_gpu()
    block = PDL_FORMATS[fmt]
    inputs = moe_inputs(1, 256, 2048, 512, 8, device="cuda")
    assert moe_config(1, 256, 1024, 2048, 9, block).BLOCK_M == 1  # the slot path
    w = _weights(2048, 2048).cuda()
    if block is None:
        moe_args, weight = _int8_moe_args(inputs), quant.quantize_int8_rows(w)
        linear, fused_moe = functools.partial(ops.linear_w8a16, bias=None), ops.fused_moe_w8a16
    else:
        moe_args, weight = _fp8_moe_args(inputs, block), quant.quantize_fp8_blocks(w, block)
        linear = functools.partial(ops.linear_fp8_block, bias=None, block_n=block[0],
                                   block_k=block[1])
        fused_moe = ops.fused_moe_fp8_block
    torch.cuda.synchronize()  # the weights are written before PDL-launched kernels read them

    def gemv(x=inputs.x):
        return linear(x, *weight)

    def slot_moe(x=inputs.x):
        return fused_moe(x, *moe_args[1:])

    steps = {"gemv": gemv, "slot_moe": slot_moe, "gemv+slot_moe": lambda: slot_moe(gemv())}
    assert_graph_bits_equal(steps[step], monkeypatch)


def test_int8_and_fp8_moe_tile_tables():
    """Each format's sorted path reads its own table in this plugin; a shape without one
    falls back to kernels_moe's bf16 table."""
    from qllm_kernels_int8.triton_moe import TABLE_DIRS, moe_config
    from qllm_kernels_moe.configs import get_config, load_table

    int8_table = load_table(256, 1024, 2048, TABLE_DIRS["int8"])
    fp8_table = load_table(256, 1024, 2048, TABLE_DIRS["fp8"])
    bf16_entry = get_config(16384, 256, 1024, 2048, 9)
    assert moe_config(16384, 256, 1024, 2048, 9) == int8_table[16384]
    assert moe_config(16384, 256, 1024, 2048, 9, (128, 128)) == fp8_table[16384]
    assert len({int8_table[16384], fp8_table[16384], bf16_entry}) == 3
    assert moe_config(300, 64, 400, 200, 5) == get_config(300, 64, 400, 200, 5)
    assert moe_config(300, 64, 400, 200, 5, (128, 128)) == get_config(300, 64, 400, 200, 5)


@cuda
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("max_tokens", [8, 200, 512, 2048, 4096, 16384], ids=lambda n: f"t{n}")
def test_table_entries(fmt, max_tokens):
    """Each format's table's sorted-path entries compile and are correct at the top of their
    token range (8 and 512 stand for the entries copied from the bf16 table; int8's 2,048 too)."""
    from qllm_kernels_int8.triton_moe import moe_config

    inputs = moe_inputs(max_tokens, 256, 2048, 512, 8, device="cuda")
    block = None if fmt == "int8" else (128, 128)
    assert moe_config(max_tokens, 256, 1024, 2048, 9, block).BLOCK_M > 1
    if fmt == "int8":
        args = _int8_moe_args(inputs)
        expected = quant.fused_moe_w8a16(args[0].float(), *args[1:5], args[5].float(),
                                         *args[6:])
        _close(ops.fused_moe_w8a16(*args), expected, torch.bfloat16)
    else:
        args = _fp8_moe_args(inputs, block)
        _close_requantized(ops.fused_moe_fp8_block(*args),
                           quant.fused_moe_fp8_w8a8_reference(*args))


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


@pytest.mark.parametrize("swept", ["0", "1"])
def test_swept_gemv_configs_are_candidates_and_switched(swept, monkeypatch):
    """``QLLM_INT8_GEMV_SWEPT=1`` takes the sweep's configs at the shapes it measured (each a
    candidate of the sweep); off, the rule's."""
    monkeypatch.setattr(gemv_configs, "SWEPT", swept == "1")
    for (rows, n, k), config in gemv_configs.SWEPT_GEMV.items():
        assert config in gemv_configs.candidates(rows, n, k)
        rule = gemv_configs._fit(rows, k, lambda block_n, n=n: -(-n // block_n))
        assert gemv_configs.default_config(rows, n, k) == (config if swept == "1" else rule)
    for (slots, n, k, rows_per_column), config in gemv_configs.SWEPT_SLOT_GEMMS.items():
        assert config in gemv_configs.candidates(1, n, k, rows_per_column)
    moe = gemv_configs.slot_moe_config(36, 512, 2048)  # four tokens: rule and sweep differ
    expected = gemv_configs.slot_gemm_config(gemv_configs.SWEPT_SLOT_GEMMS[36, 512, 2048, 2])
    assert (moe.up == expected) == (swept == "1")
