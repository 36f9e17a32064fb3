"""Micro-benchmark of the 8-bit decode kernels against bf16, and the sweep of their configs.

At Qwen3.5-35B-A3B shapes; the sweep covers the 8-bit GEMV's launch configs, dense and on the
MoE's slot path.

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
config with the elementwise int8 conversion, bf16's and cuBLAS's. ``--parts`` picks the
dense shapes, the MoE or both; ``--dry-run`` prints what would run (cases, candidate counts)
without a GPU.

    python plugins/kernels_int8/benchmarks/bench_int8.py [--rows 1 200] [--moe-tokens 1 4]
    python plugins/kernels_int8/benchmarks/bench_int8.py --sweep [--rows 1 2 4] [--parts dense]
    python plugins/kernels_int8/benchmarks/bench_int8.py --sweep --rows 200 --parts dense
    python plugins/kernels_int8/benchmarks/bench_int8.py --dry-run [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
import torch.nn.functional as F

from qllm.ops.moe import fused_moe as torch_fused_moe
from qllm.testing.benchmarking import print_table, time_ms
from qllm_kernels_int8 import gemm_configs, gemv_configs, ops, quant
from qllm_kernels_linear import ops as linear_ops
from qllm_kernels_linear.testing import QWEN3_5_35B_A3B_SHAPES, linear_inputs
from qllm_kernels_moe.configs import get_config
from qllm_kernels_moe.testing import moe_inputs

DTYPE = torch.bfloat16
DEVICE = "cuda"
PEAK_GBPS = 4300.0
SWEEP_REP_MS = 25  # per candidate: hundreds of runs of a few microseconds each
FP8_BLOCK = (128, 128)
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
    too many registers or too much shared memory)."""
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
    """Qwen3.5-35B-A3B's experts at ``tokens`` tokens: bf16, int8 and fp8 arguments."""

    def __init__(self, tokens: int):
        self.tokens = tokens
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

    def impls(self) -> list[tuple[str, object, int, torch.Tensor]]:
        from qllm_kernels_int8.triton_moe import fused_moe_8bit
        from qllm_kernels_moe.triton_moe import fused_moe_triton

        x, w13, w2, weights, ids, _, _ = self.inputs
        int8_args, fp8_args = self.args(self.int8), (*self.args(self.fp8), *FP8_BLOCK)
        int8_ref = quant.fused_moe_w8a16(*int8_args)
        sorted_config = get_config(8, EXPERTS, 2 * INTER, HIDDEN, SLOTS_PER_TOKEN)
        int8_bytes = self.expert_bytes(self.int8)
        return [
            ("bf16", functools.partial(fused_moe_triton, *self.inputs),
             self.hit * nbytes(w13[0], w2[0]), torch_fused_moe(*self.inputs)),
            ("int8_op", functools.partial(ops.fused_moe_w8a16, *int8_args), int8_bytes,
             int8_ref),
            ("int8_sorted", functools.partial(
                fused_moe_8bit, x, self.int8[0], self.int8[1], weights, ids, self.int8[2],
                self.int8[3], config=sorted_config), int8_bytes, int8_ref),
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
        if args.sweep:
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
                             "swap-AB W8A16 GEMM (5-512 rows) and the slot MoE")
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
    if args.dry_run:
        for case in plan(args):
            print(json.dumps(case))
        return
    if args.sweep:
        for rows in args.rows:
            for name in args.shapes:
                print(json.dumps(sweep_dense(name, rows)), flush=True)
        for tokens in args.moe_tokens:
            for line in sweep_moe(tokens):
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
