"""Micro-benchmark of the Triton GEMV (the ``qllm_linear::linear`` op) against ``F.linear``
(cuBLAS), and the sweep of its launch configurations.

Qwen3.5-35B-A3B projections at decode, bf16 (``qllm_kernels_linear.testing``): ``out_proj`` /
``o_proj`` ``[2048, 4096]``, the MoE ``input_proj`` ``[264, 2048]``, the GDN ``in_proj``
``[12352, 2048]`` and the attention ``qkv_proj`` ``[9216, 2048]``, at 1, 2 and 4 rows. Times
are medians of ``triton.testing.do_bench`` over CUDA-graph replays (decode runs in CUDA graphs
in the engine; ``eager_us``: plain calls, CPU launch cost included), the L2 flushed before
each run, as the weights of a decode step's other layers would flush it. GB/s is the weight's
bytes over the time (against the H200's ~4.3 TB/s); ``max_err`` the largest difference from
``F.linear``. Prints a table, then one JSON object per row.

``--inductor`` adds ``torch.compile``'s max-autotune GEMM (Inductor's Triton templates against
cuBLAS, the faster kept; its autotuning table goes to stderr), to see at which row counts a
Triton GEMM beats cuBLAS, e.g. at W2's 200 rows: ``--rows 200 --inductor``.

``--sweep`` times every candidate of ``configs.candidates`` per (rows, shape) through the
launcher, checks the fastest against ``F.linear``, and prints one JSON line per (rows, shape):
the five fastest configs, the rule's (``configs.default_config``) and cuBLAS's times, to refine
the rule; with ``--write-table`` it also writes each fastest config to the table the GEMV
takes on this GPU model (``qllm_kernels_linear.swept``). About 190 kernel variants compile on
the first shapes; ``--rows`` / ``--shapes`` split a sweep over several runs.

``--set-config ROWS SHAPE=BLOCK_N,BLOCK_K,num_warps,num_stages ...`` writes configs into that
table by hand, without timing them (``us`` null): the end-to-end trial of a config the sweep
did not pick. A config fastest alone may lose inside a decode step, where what a GEMV's
programs read before their PDL wait counts (``configs``); ``gpu_run.sh w3-gemv-tiles`` runs
W3 once per trial.

    python plugins/kernels_linear/benchmarks/bench_linear.py \
        [--rows 1 2 4] [--shapes out_proj moe_input ...]
    python plugins/kernels_linear/benchmarks/bench_linear.py --rows 200 --inductor
    python plugins/kernels_linear/benchmarks/bench_linear.py --sweep [--rows 1] \
        [--shapes out_proj] [--write-table]
    python plugins/kernels_linear/benchmarks/bench_linear.py --set-config 1 out_proj=2,4096,4,1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
import torch.nn.functional as F

from qllm.testing.benchmarking import compile_ahead, print_table, time_ms
from qllm_kernels_linear import ops, swept
from qllm_kernels_linear.configs import MAX_GEMV_ROWS, GemvConfig, candidates, default_config
from qllm_kernels_linear.testing import QWEN3_5_35B_A3B_SHAPES, linear_inputs
from qllm_kernels_linear.triton_gemv import gemv

DTYPE = torch.bfloat16
PEAK_GBPS = 4300.0
SWEEP_REP_MS = 25  # per candidate: hundreds of runs of a few microseconds each


def gbps(weight: torch.Tensor, ms: float) -> float:
    return weight.numel() * weight.element_size() / ms / 1e6


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round((out.float() - ref.float()).abs().max().item(), 4)


def measure(name: str, rows: int, inductor: bool) -> list[dict]:
    """The op (the GEMV up to ``MAX_GEMV_ROWS`` rows, cuBLAS above), cuBLAS and, with
    ``inductor``, Inductor's max-autotune GEMM on one shape."""
    x, weight, _ = inputs = linear_inputs(rows, *QWEN3_5_35B_A3B_SHAPES[name], DTYPE, "cuda")
    reference = F.linear(x, weight)
    impls = [("op", ops.linear), ("cublas", F.linear)]
    if inductor:
        impls.append(("inductor", torch.compile(F.linear, mode="max-autotune-no-cudagraphs",
                                                dynamic=False)))
    result = []
    for impl, fn in impls:
        call = functools.partial(fn, *inputs)
        ms, eager_ms = time_ms(call, graph=True), time_ms(call, graph=False)
        result.append(dict(shape=name, rows=rows, n=weight.shape[0], k=weight.shape[1],
                           impl=impl, us=round(1e3 * ms, 2), eager_us=round(1e3 * eager_ms, 2),
                           gbps=round(gbps(weight, ms), 1),
                           pct_peak_bw=round(100 * gbps(weight, ms) / PEAK_GBPS, 1),
                           max_err=max_err(call(), reference)))
    return result


COLUMNS = [("shape", "shape", 13, None), ("rows", "rows", 5, "d"), ("n", "N", 7, "d"),
           ("k", "K", 8, "d"), ("impl", "impl", 8, None), ("us", "us", 8, ".2f"),
           ("eager_us", "eager_us", 10, ".2f"), ("gbps", "GB/s", 9, ".1f"),
           ("pct_peak_bw", "%peak", 7, ".1f"), ("max_err", "max_err", 9, ".4f")]


def sweep(name: str, rows: int) -> dict:
    """Every candidate config on one shape, fastest first; failures (e.g. too much shared
    memory) are counted, not fatal."""
    x, weight, _ = linear_inputs(rows, *QWEN3_5_35B_A3B_SHAPES[name], DTYPE, "cuda")
    n, k = weight.shape
    calls = {config: functools.partial(gemv, x, weight, config=config)
             for config in candidates(rows, n, k)}
    compile_ahead(calls.values())
    timed, failed = [], 0
    for config, call in calls.items():
        try:
            ms = time_ms(call, graph=True, rep=SWEEP_REP_MS)
        except Exception:  # noqa: BLE001 - a config the GPU cannot launch is skipped
            failed += 1
            continue
        timed.append((ms, config))
    if not timed:
        raise RuntimeError(f"no candidate config ran for {rows} x {name}")
    timed.sort(key=lambda item: item[0])
    best_ms, best = timed[0]
    rule = default_config(rows, n, k)
    rule_ms = next((ms for ms, config in timed if config == rule), None)  # None: it failed
    cublas_ms = time_ms(functools.partial(F.linear, x, weight), graph=True, rep=SWEEP_REP_MS)
    return dict(shape=name, rows=rows, n=n, k=k,
                best=dataclasses.asdict(best), us=round(1e3 * best_ms, 2),
                gbps=round(gbps(weight, best_ms), 1),
                max_err=max_err(gemv(x, weight, config=best), F.linear(x, weight)),
                rule=dataclasses.asdict(rule),
                rule_us=None if rule_ms is None else round(1e3 * rule_ms, 2),
                cublas_us=round(1e3 * cublas_ms, 2),
                top=[dict(**dataclasses.asdict(config), us=round(1e3 * ms, 2))
                     for ms, config in timed[:5]],
                tried=len(timed), failed=failed)


def set_configs(rows: int, trials: list[str]) -> None:
    """Write each ``SHAPE=BLOCK_N,BLOCK_K,num_warps,num_stages`` of ``trials`` as this GPU's
    config for ``rows`` rows of that shape, untimed, and print what the table then holds."""
    device_name = torch.cuda.get_device_name()
    for trial in trials:
        name, _, fields = trial.partition("=")
        fields = fields.split(",")
        if (name not in QWEN3_5_35B_A3B_SHAPES or len(fields) != 4
                or not all(field.isdigit() for field in fields)):
            raise ValueError(f"--set-config takes SHAPE=BLOCK_N,BLOCK_K,num_warps,num_stages "
                             f"with SHAPE one of {list(QWEN3_5_35B_A3B_SHAPES)}, got {trial!r}")
        n, k = QWEN3_5_35B_A3B_SHAPES[name]
        config = GemvConfig(*map(int, fields))
        if config not in candidates(rows, n, k):
            raise ValueError(f"{config} is not among the GEMV's candidates for {rows} x {name}")
        swept.record(device_name, rows, n, k, config, us=None, rule_us=None)
    print(json.dumps({key: dataclasses.asdict(config)
                      for key, config in swept.load(device_name).items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--shapes", nargs="+", default=list(QWEN3_5_35B_A3B_SHAPES),
                        choices=list(QWEN3_5_35B_A3B_SHAPES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--write-table", action="store_true",
                        help="with --sweep: write each shape's fastest config to the GEMV's "
                             "table for this GPU (qllm_kernels_linear.swept)")
    parser.add_argument("--inductor", action="store_true",
                        help="also time torch.compile's max-autotune GEMM")
    parser.add_argument("--set-config", nargs="+", metavar="ROWS SHAPE=CONFIG",
                        help="write configs into the table by hand, e.g. 1 out_proj=2,4096,4,1 "
                             "(BLOCK_N,BLOCK_K,num_warps,num_stages)")
    args = parser.parse_args()
    if args.set_config:
        if len(args.set_config) < 2 or not args.set_config[0].isdigit():
            parser.error("--set-config takes ROWS, then SHAPE=BLOCK_N,BLOCK_K,num_warps,"
                         "num_stages ...")
        set_configs(int(args.set_config[0]), args.set_config[1:])
        return
    if args.sweep and max(args.rows) > MAX_GEMV_ROWS:
        parser.error(f"--sweep times the GEMV, which serves up to {MAX_GEMV_ROWS} rows")
    if args.write_table and not args.sweep:
        parser.error("--write-table writes what --sweep finds")
    if args.sweep:
        for rows in args.rows:
            for name in args.shapes:
                found = sweep(name, rows)
                print(json.dumps(found), flush=True)
                if args.write_table:
                    swept.record(torch.cuda.get_device_name(), rows, found["n"], found["k"],
                                 GemvConfig(**found["best"]), found["us"], found["rule_us"])
        return
    print_table([row for rows in args.rows for name in args.shapes
                 for row in measure(name, rows, args.inductor)], COLUMNS)


if __name__ == "__main__":
    main()
