"""Micro-benchmark of the 8-bit decode kernels against bf16, and the sweep of their configs.

At Qwen3.5-35B-A3B shapes; the sweep covers the 8-bit GEMV's launch configs (dense and on the
MoE's slot path), the swap-AB W8A16 GEMM's and the tiles of the MoE's sorted path.

Dense (``qllm_kernels_linear.testing``'s projection shapes; by default the three that become
8-bit: ``out_proj`` / ``o_proj`` ``[2048, 4096]``, the GDN ``in_proj`` ``[12352, 2048]``, the
attention ``qkv_proj`` ``[9216, 2048]``; the MoE ``input_proj`` ``[264, 2048]`` stays bf16 in
the model) at ``--rows`` (1 and 200): ``cublas`` (``F.linear``, bf16), ``bf16_op``
(kernels_linear's op: its GEMV where it serves, else cuBLAS), ``int8_op`` (``linear_w8a16``:
the 8-bit GEMV up to 4 rows, a W8A16 GEMM up to 512), ``int8_gemv_elementwise`` (up to 4 rows:
the GEMV with Triton's elementwise int8 conversion instead of the inline PTX),
``int8_shared_b`` and ``int8_swap_ab`` (5-512 rows: each W8A16 GEMM at its rule's config,
whichever ``int8_op`` takes; ``triton_linear.w8a16_gemm`` converts the weights as the MMA's
shared-memory operand, ``triton_w8a16`` as its register operand), ``fp8_op``
(``linear_fp8_block``, 128 x 128 blocks). MoE (Qwen3.5-35B-A3B's experts, top-8 plus the shared
expert) at ``--moe-tokens`` (1 and 4): ``bf16`` (kernels_moe), ``int8_op`` (the slot path at
those counts), ``int8_sorted`` (the sorted path with kernels_moe's 8-token tiles: what the op
ran at 1-4 tokens before the slot path), ``fp8_op``.

Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays (decode runs in CUDA
graphs), the L2 flushed before each run; GB/s is the weight bytes a call must read (with the
scales; MoE: the experts hit) over the time, against the H200's ~4.3 TB/s; ``max_err`` the
largest difference from the format's plain-torch reference. Prints a table, then one JSON
object per row, then ``decode_step`` lines: per implementation, the 1-row times weighted by
how often a W3 decode step runs each shape (30 GDN and 10 attention layers, 40 MoE blocks).

``--sweep`` times every candidate of ``gemv_configs.candidates`` per (rows <= 4, shape) and,
for the MoE slot path, per GEMM (gate-up, down) and token count, and prints one JSON line
each: the five fastest, the rule's time (``default_config`` / ``slot_moe_config``), the best
config with the elementwise int8 conversion, bf16's and cuBLAS's; at 5-512 rows, every
candidate of ``gemm_configs.swap_ab_candidates``.

At MoE token counts where the op takes the sorted path (its table entry has ``BLOCK_M`` > 1:
5 tokens and more), ``--sweep`` times the sorted path's tiles instead
(``triton_moe.fused_moe_8bit``'s, from the plugin's table of the format,
``triton_moe.moe_config``): each GEMM alone (gate-up on ``x``, down on its output;
``triton_moe._launch`` on the sort at each ``BLOCK_M``) at every candidate of kernels_moe's
tuning grid (``bench_moe.py``'s ``gemm_candidates`` over one of its ``GRIDS``, the rule's
tiles added), one
JSON line per GEMM (``moe_sorted_gate_up``, ``moe_sorted_down``: the five fastest, the rule's
time), then one ``moe_sorted`` line: per ``BLOCK_M`` the align plus each GEMM's best, and the
fastest of those sums timed as the whole op against the rule's config (what the op runs
today) and bf16 (kernels_moe's ``fused_moe_triton`` at its table entry), each with GB/s, and
the best's ``max_err``. The grid (``--grid``): ``decode`` where the experts see few tokens
(routed slots ``T * k <= 32 E``, kernels_moe's ``default_config`` boundary: weight
streaming, W2's 200 tokens), else ``quick`` (a 16,384-token prefill step). ``BLOCK_M``
(``--block-m``): the rule's, and the next of ``bench_moe.BLOCK_MS`` where an average routed
expert holds more slots than a block (there each int8 tile, converted once per block, may pay
for a taller one); grouped launch orders (``GROUP_M`` 8) only there too (at 200 tokens only
the shared expert spans several 16-slot blocks, and its 3 MB of int8 weights stay in L2).
The candidates are the sum over the two GEMMs, not their product: 64 at 200 tokens, 72 at
16,384, about 83 and 94 s on an H200 at ``SWEEP_COMPILE_S`` + ``SWEEP_TIMING_S`` per
candidate (a compile each: gate-up and down are separate specializations), under 150 s per
token count; ``--dry-run`` prints the counts and that estimate (``est_s``).
(``gemm_candidates`` bounds shared memory with bf16 weight tiles: the int8 ones take half,
but the converted tile needs a bf16 copy besides.)

``--format fp8`` runs the same sweep on the fp8 (W8A8, 128 x 128 block scales) sorted path:
the candidates whose ``BLOCK_K`` lies within a 128-column scale block (``triton_moe._fit``;
the decode grid keeps its 128), each GEMM timed on activations quantized as the op does
(``fp8_group_quant``, outside the timed call), against the fp8 rule (the plugin's fp8
table, ``moe_config(..., block)``), bf16 and the int8 op (``int8_op_us``), ``max_err``
against the W8A8 reference (``quant.fused_moe_fp8_w8a8_reference``). ``BLOCK_M`` adds
``FP8_BLOCK_MS``: 32 and 64 at decode batches (the fp8 wgmma needs 64 rows; at 16 and 32
the fp8 tiles are converted for fp16 ``mma.sync``, ``sass_moe.py``), 64 beyond. 104
candidates at 200 tokens, 152 at 16,384: about 135 and 198 s. (fp8 tiles take half the
shared memory ``gemm_candidates`` counts, so it leaves out some that would fit.)

``--parts`` picks the dense shapes, the MoE or both; ``--dry-run`` prints what would run
(cases, candidate counts) without a GPU.

    python plugins/kernels_int8/benchmarks/bench_int8.py [--rows 1 200] [--moe-tokens 1 4]
    python plugins/kernels_int8/benchmarks/bench_int8.py --sweep [--rows 1 2 4] [--parts dense]
    python plugins/kernels_int8/benchmarks/bench_int8.py --sweep --rows 200 --parts dense
    python plugins/kernels_int8/benchmarks/bench_int8.py --sweep --parts moe \
        --moe-tokens 200 16384 [--grid decode|quick|full] [--block-m 16 32] [--format fp8]
    python plugins/kernels_int8/benchmarks/bench_int8.py --dry-run [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from qllm.ops.moe import fused_moe as torch_fused_moe
from qllm.testing.benchmarking import compile_ahead, print_table, time_ms
from qllm_kernels_int8 import gemm_configs, gemv_configs, ops, quant
from qllm_kernels_linear import ops as linear_ops
from qllm_kernels_linear.testing import QWEN3_5_35B_A3B_SHAPES, linear_inputs
from qllm_kernels_moe.configs import GemmConfig, MoeConfig
from qllm_kernels_moe.testing import moe_inputs

DTYPE = torch.bfloat16
DEVICE = "cuda"
PEAK_GBPS = 4300.0
SWEEP_REP_MS = 25  # per candidate: hundreds of runs of a few microseconds each
# The sorted MoE sweep's cost per candidate on an H200, for --dry-run's estimate: a compile,
# then do_bench's warmup and SWEEP_REP_MS of graph replays
SWEEP_COMPILE_S, SWEEP_TIMING_S = 1.0, 0.3
BENCH_MOE = Path(__file__).resolve().parents[2] / "kernels_moe" / "benchmarks" / "bench_moe.py"
FP8_BLOCK = (128, 128)
SCALE_BLOCKS = {"int8": None, "fp8": FP8_BLOCK}  # the sorted path's ``block`` per format
# fp8's sorted sweep also tries these BLOCK_M (at decode batches, else beyond): the fp8 wgmma
# (QGMMA) takes 64 rows per warpgroup, below that Triton runs fp16 mma.sync on converted tiles;
# at 16,384 tokens 64 rows spill less than the table's 128 (sass_moe.py)
FP8_BLOCK_MS = {True: (32, 64), False: (64,)}
INT8_SHAPES = ("out_proj", "gdn_in_proj", "qkv_proj")  # the projections that become 8-bit
EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
SLOTS_PER_TOKEN = TOP_K + 1  # the shared expert's slot
# How often one decode step of Qwen3.5-35B-A3B (30 GDN + 10 attention layers) runs each.
STEP_COUNTS = {"gdn_in_proj": 30, "out_proj": 40, "qkv_proj": 10, "moe_input": 40, "moe": 40}


def gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / ms / 1e6


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round((out.float() - ref.float()).abs().max().item(), 4)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def result(impl: str, ms: float, num_bytes: int, err: float, **case) -> dict:
    """One row of the report."""
    return dict(**case, impl=impl, us=round(1e3 * ms, 2), gbps=round(gbps(num_bytes, ms), 1),
                pct_peak_bw=round(100 * gbps(num_bytes, ms) / PEAK_GBPS, 1), max_err=err)


# ----------------------------------------------------------------------------- dense


class DenseCase:
    """One projection shape at ``rows`` rows: bf16 inputs, their int8 and fp8 weights."""

    def __init__(self, name: str, rows: int):
        self.name, self.rows = name, rows
        self.x, self.weight, _ = linear_inputs(rows, *QWEN3_5_35B_A3B_SHAPES[name], DTYPE,
                                               DEVICE)
        self.q, self.scale = quant.quantize_int8_rows(self.weight)
        self.qf, self.scale_inv = quant.quantize_fp8_blocks(self.weight, FP8_BLOCK)

    @property
    def fields(self) -> dict:
        n, k = self.weight.shape
        return dict(shape=self.name, rows=self.rows, n=n, k=k)

    @property
    def gemv(self) -> bool:
        """Whether the 8-bit GEMV serves these rows (else a W8A16 GEMM)."""
        return self.rows <= gemv_configs.GEMV_MAX_ROWS

    def int8_gemv(self, **kwargs):
        from qllm_kernels_int8.triton_gemv import gemv_8bit

        return functools.partial(gemv_8bit, self.x, self.q, self.scale, None, **kwargs)

    def swap_ab(self, **kwargs):
        from qllm_kernels_int8.triton_w8a16 import w8a16_gemm_swap_ab

        return functools.partial(w8a16_gemm_swap_ab, self.x, self.q, self.scale, None, **kwargs)

    def shared_b(self):
        from qllm_kernels_int8.triton_linear import w8a16_gemm

        return functools.partial(w8a16_gemm, self.x, self.q, self.scale, None)

    def impls(self) -> list[tuple[str, object, int, torch.Tensor]]:
        """``(name, call, weight bytes, reference output)`` per implementation."""
        x, weight, q, scale = self.x, self.weight, self.q, self.scale
        bf16_ref = F.linear(x, weight)
        int8_ref = quant.linear_w8a16(x, q, scale, None)
        fp8_ref = (quant.linear_fp8_block if self.gemv
                   else quant.linear_fp8_w8a8_reference)(x, self.qf, self.scale_inv, None,
                                                         *FP8_BLOCK)
        found = [("cublas", functools.partial(F.linear, x, weight), nbytes(weight), bf16_ref),
                 ("bf16_op", functools.partial(linear_ops.linear, x, weight, None),
                  nbytes(weight), bf16_ref),
                 ("int8_op", functools.partial(ops.linear_w8a16, x, q, scale, None),
                  nbytes(q, scale), int8_ref)]
        if self.gemv:
            found.append(("int8_gemv_elementwise", self.int8_gemv(fast_int8=False),
                          nbytes(q, scale), int8_ref))
        else:
            found += [("int8_shared_b", self.shared_b(), nbytes(q, scale), int8_ref),
                      ("int8_swap_ab", self.swap_ab(), nbytes(q, scale), int8_ref)]
        found.append(("fp8_op", functools.partial(ops.linear_fp8_block, x, self.qf,
                                                  self.scale_inv, None, *FP8_BLOCK),
                      nbytes(self.qf, self.scale_inv), fp8_ref))
        return found


def measure_dense(name: str, rows: int) -> list[dict]:
    case = DenseCase(name, rows)
    return [result(impl, time_ms(call, graph=True), num_bytes, max_err(call(), ref),
                   **case.fields) for impl, call, num_bytes, ref in case.impls()]


def timed_configs(configs: list, make_call) -> tuple[list[tuple[float, object]], int]:
    """``(ms, config)`` of each config that runs, fastest first, and how many failed (e.g.
    too many registers or too much shared memory). All compile first, in parallel."""
    compile_ahead([lambda config=config: make_call(config)() for config in configs])
    timed, failed = [], 0
    for config in configs:
        try:
            timed.append((time_ms(make_call(config), graph=True, rep=SWEEP_REP_MS), config))
        except Exception:  # noqa: BLE001 - a config the GPU cannot launch is skipped
            failed += 1
    if not timed:
        raise RuntimeError("no candidate config ran")
    return sorted(timed, key=lambda item: item[0]), failed


def sweep_report(timed, failed: int, rule, num_bytes: int, **fields) -> dict:
    """The sweep's JSON line: the best config, the rule's (None: not among those that ran),
    the five fastest."""
    best_ms, best = timed[0]
    rule_ms = next((ms for ms, config in timed if config == rule), None)
    return dict(**fields, best=dataclasses.asdict(best), us=round(1e3 * best_ms, 2),
                gbps=round(gbps(num_bytes, best_ms), 1), rule=dataclasses.asdict(rule),
                rule_us=None if rule_ms is None else round(1e3 * rule_ms, 2),
                top=[dict(**dataclasses.asdict(config), us=round(1e3 * ms, 2))
                     for ms, config in timed[:5]], tried=len(timed), failed=failed)


def us(call) -> float:
    """A call's sweep time, us."""
    return round(1e3 * time_ms(call, graph=True, rep=SWEEP_REP_MS), 2)


def dense_space(rows: int, n: int, k: int) -> tuple[list, object]:
    """The sweep's candidates and the rule's config for ``rows`` rows through ``weight [n,
    k]``: the GEMV's up to ``GEMV_MAX_ROWS`` rows, the swap-AB GEMM's beyond."""
    if rows <= gemv_configs.GEMV_MAX_ROWS:
        return gemv_configs.candidates(rows, n, k), gemv_configs.default_config(rows, n, k)
    return gemm_configs.swap_ab_candidates(rows, n, k), gemm_configs.swap_ab_config(rows, n, k)


def sweep_dense(name: str, rows: int) -> dict:
    """Every GEMV candidate on one shape (rows <= 4; the best also with the elementwise
    conversion), or every swap-AB GEMM candidate (the best also with Triton's int8 cast, and
    the shared-B GEMM)."""
    from qllm_kernels_linear.triton_gemv import gemv as bf16_gemv

    case = DenseCase(name, rows)
    n, k = case.weight.shape
    candidates, rule = dense_space(rows, n, k)
    make_call = case.int8_gemv if case.gemv else case.swap_ab
    timed, failed = timed_configs(candidates, lambda config: make_call(config=config))
    best = timed[0][1]
    ref = quant.linear_w8a16(case.x, case.q, case.scale, None)
    if case.gemv:
        extra = dict(elementwise_us=us(case.int8_gemv(config=best, fast_int8=False)),
                     bf16_gemv_us=us(functools.partial(bf16_gemv, case.x, case.weight)))
    else:
        extra = dict(cast_us=us(case.swap_ab(config=best, fast_int8=False)),
                     shared_b_us=us(case.shared_b()),
                     bf16_op_us=us(functools.partial(linear_ops.linear, case.x, case.weight,
                                                     None)))
    return sweep_report(
        timed, failed, rule, nbytes(case.q, case.scale), **case.fields,
        max_err=max_err(make_call(config=best)(), ref), **extra,
        cublas_us=us(functools.partial(F.linear, case.x, case.weight)))


# ----------------------------------------------------------------------------- MoE


class MoeCase:
    """Qwen3.5-35B-A3B's experts at ``tokens`` tokens: bf16, int8 and fp8 arguments;
    ``quantize`` the fp8 sorted path's activation quantization (default the op's,
    ``fp8_group_quant``)."""

    def __init__(self, tokens: int, quantize=None):
        from qllm_kernels_int8.triton_linear import fp8_group_quant

        self.tokens = tokens
        self.quantize = quantize or fp8_group_quant
        self.inputs = moe_inputs(tokens, EXPERTS, HIDDEN, INTER, TOP_K, DTYPE, DEVICE)
        x, w13, w2, weights, ids, shared_w13, shared_w2 = self.inputs
        self.int8 = [quant.quantize_int8_rows(w) for w in (w13, w2, shared_w13, shared_w2)]
        self.fp8 = [quant.quantize_fp8_blocks(w, FP8_BLOCK)
                    for w in (w13, w2, shared_w13, shared_w2)]
        self.hit = ids.unique().numel()  # experts read, the shared expert's included

    def args(self, parts: list) -> tuple:
        """The 8-bit op's arguments from ``(weight, scale)`` of w13, w2 and the shared pair."""
        x, _, _, weights, ids, _, _ = self.inputs
        return (x, *parts[0], *parts[1], weights, ids, *parts[2], *parts[3])

    def expert_bytes(self, parts: list) -> int:
        """Bytes of the experts hit: each one's w13 and w2 with their scales."""
        return self.hit * sum(nbytes(w[0], s[0]) for w, s in parts[:2])

    @property
    def bf16_bytes(self) -> int:
        """Bytes of the bf16 experts hit."""
        return self.hit * nbytes(self.inputs.w13[0], self.inputs.w2[0])

    def sorted_inputs(self, a: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A sorted-path GEMM's input ``a [rows, K]`` as ``fused_moe_8bit`` passes it, with
        its scales: int8 ``(a, a)`` (no activation scales: ``a`` stands in for their
        pointer), fp8 ``(q [rows, K] e4m3, scale [rows, K / 128])``."""
        return (a, a) if SCALE_BLOCKS[fmt] is None else self.quantize(a, FP8_BLOCK[1])

    def sorted_gemm(self, fmt: str, gated: bool, a: tuple[torch.Tensor, torch.Tensor],
                    sorts: dict, config):
        """One GEMM of the ``fmt`` sorted path alone (``triton_moe._launch``, as
        ``fused_moe_8bit`` launches it) at ``config``, a ``SortedGemmConfig``, on the slots
        sorted at its ``BLOCK_M`` (``sorts``: ``BLOCK_M`` -> ``moe_align_triton``'s): gate-up
        (``gated``, ``a`` from ``x [T, H]``) -> ``hidden [S, I]``, or down (``a`` from
        ``hidden``) -> ``[S, H]``, as a call; ``a`` as ``sorted_inputs`` gives it."""
        from qllm_kernels_int8.triton_moe import _launch

        weights = self.inputs.topk_weights
        w13, w2, shared_w13, shared_w2 = getattr(self, fmt)
        weight, shared, width = (w13, shared_w13, INTER) if gated else (w2, shared_w2, HIDDEN)

        def call() -> torch.Tensor:
            out = self.inputs.x.new_empty(self.tokens * SLOTS_PER_TOKEN, width)
            # gate-up has no routing weights: ``out`` stands in
            return _launch(*a, *weight, *shared, out, out if gated else weights,
                           sorts[config.BLOCK_M], config.BLOCK_M, config.tiles,
                           slots_per_a_row=SLOTS_PER_TOKEN if gated else 1, gated=gated,
                           block=SCALE_BLOCKS[fmt])

        return call

    def sorted_op(self, fmt: str, config: MoeConfig):
        """The whole ``fmt`` op (``fused_moe_8bit``) at ``config``, as a call."""
        from qllm_kernels_int8.triton_moe import fused_moe_8bit

        x, _, _, weights, ids, _, _ = self.inputs
        w13, w2, shared_w13, shared_w2 = getattr(self, fmt)
        return functools.partial(fused_moe_8bit, x, w13, w2, weights, ids, shared_w13,
                                 shared_w2, block=SCALE_BLOCKS[fmt], config=config,
                                 quantize=self.quantize)

    def sorted_reference(self, fmt: str) -> torch.Tensor:
        """What the ``fmt`` sorted path computes, ``[T, k, H]``: the W8A16 reference, or
        the W8A8 one (activations quantized per token and group, as the op does)."""
        if SCALE_BLOCKS[fmt] is None:
            return quant.fused_moe_w8a16(*self.args(self.int8))
        return quant.fused_moe_fp8_w8a8_reference(*self.args(self.fp8), *FP8_BLOCK)

    def impls(self) -> list[tuple[str, object, int, torch.Tensor]]:
        from qllm_kernels_moe.triton_moe import fused_moe_triton

        int8_args, fp8_args = self.args(self.int8), (*self.args(self.fp8), *FP8_BLOCK)
        int8_ref = quant.fused_moe_w8a16(*int8_args)
        sorted_config = table_config(8)
        int8_bytes = self.expert_bytes(self.int8)
        return [
            ("bf16", functools.partial(fused_moe_triton, *self.inputs), self.bf16_bytes,
             torch_fused_moe(*self.inputs)),
            ("int8_op", functools.partial(ops.fused_moe_w8a16, *int8_args), int8_bytes,
             int8_ref),
            ("int8_sorted", self.sorted_op("int8", sorted_config), int8_bytes, int8_ref),
            ("fp8_op", functools.partial(ops.fused_moe_fp8_block, *fp8_args),
             self.expert_bytes(self.fp8), quant.fused_moe_fp8_block(*fp8_args)),
        ]


def measure_moe(tokens: int) -> list[dict]:
    case = MoeCase(tokens)
    return [result(impl, time_ms(call, graph=True), num_bytes, max_err(call(), ref),
                   shape="moe", rows=tokens)
            for impl, call, num_bytes, ref in case.impls()]


def sweep_moe(tokens: int) -> list[dict]:
    """Every candidate of each slot-path GEMM alone (gate-up on ``x``, down on its output)."""
    from qllm_kernels_int8.triton_slot_moe import slot_down_8bit, slot_gate_up_8bit

    case = MoeCase(tokens)
    x, _, _, weights, ids, _, _ = case.inputs
    (w13, w2, shared_w13, shared_w2), slots = case.int8, tokens * SLOTS_PER_TOKEN
    rule = gemv_configs.slot_moe_config(slots, INTER, HIDDEN)
    hidden = slot_gate_up_8bit(x, w13, shared_w13, ids, rule.up)
    gemms = {
        "moe_gate_up": (lambda c: functools.partial(slot_gate_up_8bit, x, w13, shared_w13, ids,
                                                    c), INTER, HIDDEN, 2, rule.up, w13),
        "moe_down": (lambda c: functools.partial(slot_down_8bit, hidden, w2, shared_w2,
                                                 weights, ids, c), HIDDEN, INTER, 1,
                     rule.down, w2)}
    found = []
    for name, (make_call, n, k, rows_per_column, rule_config, weight) in gemms.items():
        configs = [gemv_configs.slot_gemm_config(config)
                   for config in gemv_configs.candidates(1, n, k, rows_per_column)]
        timed, failed = timed_configs(configs, make_call)
        num_bytes = case.hit * nbytes(weight[0][0], weight[1][0])  # the experts hit
        found.append(sweep_report(timed, failed, rule_config, num_bytes, shape=name,
                                  rows=tokens, n=n, k=k))
    return found


# ----------------------------------------------------------------------------- MoE, sorted


@dataclasses.dataclass(frozen=True)
class SortedGemmConfig:
    """One GEMM of the sorted path: the sort's ``BLOCK_M`` (slots per block) and the tiles."""

    BLOCK_M: int
    tiles: GemmConfig


def table_config(tokens: int, fmt: str = "int8") -> MoeConfig:
    """The ``fmt`` op's config at ``tokens`` tokens (``moe_config``: int8 from the plugin's
    table, fp8 from kernels_moe's bf16 one): the sorted path's where ``BLOCK_M`` > 1, else
    the slot path's."""
    from qllm_kernels_int8.triton_moe import moe_config

    return moe_config(tokens, EXPERTS, 2 * INTER, HIDDEN, SLOTS_PER_TOKEN, SCALE_BLOCKS[fmt])


def rule_gemms(rule: MoeConfig, fmt: str) -> dict[str, SortedGemmConfig]:
    """Each GEMM's config (``gate_up``, ``down``) under ``rule`` as the ``fmt`` op runs it
    (fp8: ``BLOCK_K`` fitted to the scale block, ``triton_moe._fit``)."""
    from qllm_kernels_int8.triton_moe import _fit

    block = SCALE_BLOCKS[fmt]
    return {"gate_up": SortedGemmConfig(rule.BLOCK_M, _fit(rule.up, block)),
            "down": SortedGemmConfig(rule.BLOCK_M, _fit(rule.down, block))}


@functools.cache
def bench_moe():
    """kernels_moe's benchmark (a script, not a package: loaded from its file) for its tuning
    grids: ``GRIDS``, ``gemm_candidates``, ``BLOCK_MS``."""
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH_MOE)
    module = sys.modules["bench_moe"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sorted_space(tokens: int, grid: str | None = None, block_ms: list[int] | None = None,
                 fmt: str = "int8") -> tuple[str, dict[str, list[SortedGemmConfig]], MoeConfig]:
    """The ``fmt`` sorted sweep at ``tokens`` tokens: its grid's name, each GEMM's candidates
    (``gate_up``, ``down``: ``bench_moe.gemm_candidates`` per ``BLOCK_M``, fp8's those whose
    ``BLOCK_K`` lies within a scale block, the rule's tiles added) and the rule
    (``table_config``). Defaults in the module docstring."""
    from qllm_kernels_int8.triton_moe import _fit

    moe = bench_moe()
    rule, block = table_config(tokens, fmt), SCALE_BLOCKS[fmt]
    routed_per_expert = tokens * TOP_K / EXPERTS  # slots of an average routed expert
    decode = tokens * TOP_K <= 32 * EXPERTS  # the experts stream their weights
    grid = grid or ("decode" if decode else "quick")
    if block_ms is None:
        taller = [m for m in moe.BLOCK_MS if m > rule.BLOCK_M][:1]
        block_ms = [rule.BLOCK_M] + (taller if routed_per_expert > rule.BLOCK_M else [])
        if block is not None:
            block_ms = sorted({*block_ms, *FP8_BLOCK_MS[decode]})
    candidates = {}
    for name, rule_gemm in rule_gemms(rule, fmt).items():
        found = [SortedGemmConfig(m, tiles) for m in block_ms
                 for tiles in moe.gemm_candidates(m, name == "gate_up", routed_per_expert > m,
                                                  moe.GRIDS[grid])
                 if _fit(tiles, block) == tiles]
        if rule_gemm not in found:
            found.append(rule_gemm)
        candidates[name] = found
    return grid, candidates, rule


def sorted_estimate_s(candidates: dict[str, list[SortedGemmConfig]]) -> float:
    """The sorted sweep's seconds on an H200 over ``candidates`` (``sorted_space``'s), at
    ``SWEEP_COMPILE_S`` + ``SWEEP_TIMING_S`` per candidate: ``--dry-run``'s ``est_s``."""
    return sum(map(len, candidates.values())) * (SWEEP_COMPILE_S + SWEEP_TIMING_S)


def sweep_sorted(tokens: int, grid: str | None = None, block_ms: list[int] | None = None,
                 fmt: str = "int8") -> list[dict]:
    """Every candidate of each ``fmt`` sorted-path GEMM alone, then the whole op at the best
    sum (align + gate-up + down) per ``BLOCK_M``, against the rule and bf16 (fp8: and the
    int8 op)."""
    from qllm_kernels_moe.triton_align import moe_align_triton
    from qllm_kernels_moe.triton_moe import fused_moe_triton

    case = MoeCase(tokens)
    grid, candidates, rule = sorted_space(tokens, grid, block_ms, fmt)
    ids, parts = case.inputs.topk_ids, getattr(case, fmt)
    sorts = {config.BLOCK_M: moe_align_triton(ids, EXPERTS + 1, config.BLOCK_M)
             for found in candidates.values() for config in found}
    rules = rule_gemms(rule, fmt)
    x_in = case.sorted_inputs(case.inputs.x, fmt)
    hidden = case.sorted_gemm(fmt, True, x_in, sorts, rules["gate_up"])()  # down's input
    gemms = {"gate_up": (True, x_in, INTER, HIDDEN, parts[0]),
             "down": (False, case.sorted_inputs(hidden, fmt), HIDDEN, INTER, parts[1])}
    found, fastest = [], {}  # fastest: GEMM -> BLOCK_M -> (ms, tiles)
    for name, (gated, a, n, k, weight) in gemms.items():
        timed, failed = timed_configs(candidates[name],
                                      functools.partial(case.sorted_gemm, fmt, gated, a, sorts))
        fastest[name] = {}
        for ms, config in timed:  # fastest first
            fastest[name].setdefault(config.BLOCK_M, (ms, config.tiles))
        num_bytes = case.hit * nbytes(weight[0][0], weight[1][0])  # the experts hit
        found.append(sweep_report(timed, failed, rules[name], num_bytes,
                                  shape=f"moe_sorted_{name}", format=fmt, rows=tokens, n=n,
                                  k=k, grid=grid))
    sums = {}  # BLOCK_M -> ms of the align and each GEMM's best
    for block_m in fastest["gate_up"].keys() & fastest["down"].keys():
        align_ms = time_ms(functools.partial(moe_align_triton, ids, EXPERTS + 1, block_m),
                           graph=True, rep=SWEEP_REP_MS)
        sums[block_m] = align_ms + fastest["gate_up"][block_m][0] + fastest["down"][block_m][0]
    block_m = min(sums, key=sums.get)
    best = MoeConfig(block_m, fastest["gate_up"][block_m][1], fastest["down"][block_m][1])

    def timing(ms: float, num_bytes: int, prefix: str = "") -> dict:
        return {f"{prefix}us": round(1e3 * ms, 2), f"{prefix}gbps": round(gbps(num_bytes, ms), 1)}

    op_bytes = case.expert_bytes(parts)
    best_ms, rule_ms = (time_ms(case.sorted_op(fmt, config), graph=True)
                        for config in (best, rule))
    bf16_ms = time_ms(functools.partial(fused_moe_triton, *case.inputs), graph=True)
    int8_op = {} if fmt == "int8" else timing(
        time_ms(functools.partial(ops.fused_moe_w8a16, *case.args(case.int8)), graph=True),
        case.expert_bytes(case.int8), "int8_op_")
    found.append(dict(
        shape="moe_sorted", format=fmt, rows=tokens, grid=grid, best=best.to_json(),
        **timing(best_ms, op_bytes), rule=rule.to_json(), **timing(rule_ms, op_bytes, "rule_"),
        **timing(bf16_ms, case.bf16_bytes, "bf16_"), **int8_op,
        sums_us={m: round(1e3 * ms, 2) for m, ms in sorted(sums.items())},
        max_err=max_err(case.sorted_op(fmt, best)(), case.sorted_reference(fmt))))
    return found


# ----------------------------------------------------------------------------- report

COLUMNS = [("shape", "shape", 12, None), ("rows", "rows", 5, "d"), ("n", "N", 6, None),
           ("k", "K", 5, None), ("impl", "impl", 22, None), ("us", "us", 8, ".2f"),
           ("gbps", "GB/s", 8, ".1f"), ("pct_peak_bw", "%peak", 6, ".1f"),
           ("max_err", "max_err", 8, ".4f")]


def decode_step(rows: list[dict]) -> list[dict]:
    """Per implementation family (bf16: ``bf16_op`` dense + ``bf16`` MoE; int8 and fp8: their
    ops), the one-row times weighted by ``STEP_COUNTS``, over the shapes measured."""
    families = {"bf16": ("bf16_op", "bf16"), "int8": ("int8_op",), "fp8": ("fp8_op",)}
    found = []
    for family, impls in families.items():
        parts = {row["shape"]: row["us"] * STEP_COUNTS[row["shape"]] for row in rows
                 if row["rows"] == 1 and row["impl"] in impls}
        if parts:
            found.append(dict(decode_step=family, us=round(sum(parts.values()), 1),
                              parts={shape: round(us, 1) for shape, us in parts.items()}))
    return found


def plan(args) -> list[dict]:
    """What a run with ``args`` would time, for ``--dry-run``."""
    cases = []
    for rows in args.rows:
        for name in args.shapes:
            n, k = QWEN3_5_35B_A3B_SHAPES[name]
            case = dict(shape=name, rows=rows, n=n, k=k)
            if args.sweep:
                candidates, rule = dense_space(rows, n, k)
                case.update(candidates=len(candidates), rule=dataclasses.asdict(rule))
            cases.append(case)
    for tokens in args.moe_tokens:
        case = dict(shape="moe", rows=tokens, slots=tokens * SLOTS_PER_TOKEN)
        if args.sweep and table_config(tokens, args.format).BLOCK_M > 1:
            grid, candidates, rule = sorted_space(tokens, args.grid, args.block_m, args.format)
            case.update(shape="moe_sorted", format=args.format, grid=grid,
                        block_m=sorted({c.BLOCK_M for found in candidates.values()
                                        for c in found}),
                        candidates=[len(found) for found in candidates.values()],
                        est_s=round(sorted_estimate_s(candidates)), rule=rule.to_json())
        elif args.sweep:
            rule = gemv_configs.slot_moe_config(tokens * SLOTS_PER_TOKEN, INTER, HIDDEN)
            case.update(candidates=[len(gemv_configs.candidates(1, INTER, HIDDEN, 2)),
                                    len(gemv_configs.candidates(1, HIDDEN, INTER))],
                        rule=dict(up=dataclasses.asdict(rule.up),
                                  down=dataclasses.asdict(rule.down)))
        cases.append(case)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int,
                        help="dense row counts (default 1 and 200; with --sweep, 1)")
    parser.add_argument("--shapes", nargs="+", default=list(INT8_SHAPES),
                        choices=list(QWEN3_5_35B_A3B_SHAPES))
    parser.add_argument("--moe-tokens", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--parts", nargs="+", choices=["dense", "moe"], default=["dense", "moe"])
    parser.add_argument("--sweep", action="store_true",
                        help="time every launch config of the 8-bit GEMV (up to 4 rows), the "
                             "swap-AB W8A16 GEMM (5-512 rows), the slot MoE (1-4 tokens) and "
                             "the sorted MoE's tiles (5 tokens and more)")
    parser.add_argument("--grid", help="the sorted MoE sweep's tile grid, one of kernels_moe's "
                                       "bench_moe.py GRIDS (full, quick, decode); default: "
                                       "decode for decode batches, quick beyond")
    parser.add_argument("--block-m", nargs="+", type=int,
                        help="the sorted MoE sweep's BLOCK_M values (16, 32, 64, 128); "
                             "default: the table's and, where experts hold more slots, the "
                             "next")
    parser.add_argument("--format", choices=list(SCALE_BLOCKS), default="int8",
                        help="the sorted MoE sweep's weight format (fp8: that sweep alone)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the cases as JSON lines; needs no GPU")
    args = parser.parse_args()
    args.rows = args.rows or ([1] if args.sweep else [1, 200])
    if "dense" not in args.parts:
        args.rows = []
    if "moe" not in args.parts:
        args.moe_tokens = []
    if args.sweep and max(args.rows, default=1) > ops.GEMM_MAX_ROWS:
        parser.error(f"--sweep times the W8A16 GEMM up to {ops.GEMM_MAX_ROWS} rows")
    if args.grid and args.grid not in bench_moe().GRIDS:
        parser.error(f"--grid {args.grid}: one of {', '.join(bench_moe().GRIDS)}")
    sorted_block_ms = [m for m in bench_moe().BLOCK_MS if m > 1] if args.block_m else []
    if set(args.block_m or ()) - set(sorted_block_ms):
        parser.error(f"--block-m: of {sorted_block_ms}")
    if args.format != "int8" and (not args.sweep or args.rows or any(
            table_config(tokens, args.format).BLOCK_M == 1 for tokens in args.moe_tokens)):
        parser.error(f"--format {args.format}: the sorted MoE sweep alone (--sweep --parts "
                     f"moe, --moe-tokens where the op sorts the slots: 5 and more)")
    if args.dry_run:
        for case in plan(args):
            print(json.dumps(case))
        return
    if args.sweep:
        for rows in args.rows:
            for name in args.shapes:
                print(json.dumps(sweep_dense(name, rows)), flush=True)
        for tokens in args.moe_tokens:
            lines = (sweep_moe(tokens) if table_config(tokens, args.format).BLOCK_M == 1
                     else sweep_sorted(tokens, args.grid, args.block_m, args.format))
            for line in lines:
                print(json.dumps(line), flush=True)
        return
    rows = [row for count in args.rows for name in args.shapes
            for row in measure_dense(name, count)]
    rows += [row for tokens in args.moe_tokens for row in measure_moe(tokens)]
    print_table(rows, COLUMNS)
    for line in decode_step(rows):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
