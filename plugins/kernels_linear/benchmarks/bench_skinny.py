"""Micro-benchmark of the few-row GEMM (``triton_skinny``) against ``F.linear`` (cuBLAS), with
a sweep of its launch configurations around the rule.

Shapes: Qwen3-0.6B's projections (W1's model: ``testing.QWEN3_0_6B_SHAPES``) and
Qwen3.5-35B-A3B's (``QWEN3_5_35B_A3B_SHAPES``), bf16, at 8, 16, 32 and 64 rows (decode batches
the GEMV does not serve). Times are medians of ``triton.testing.do_bench`` over CUDA-graph
replays, the L2 flushed before each. One JSON line per (model, shape, rows): cuBLAS's time,
the rule's (``triton_skinny.default_config``), the five fastest configs, and GB/s of the
weight at the best; ``max_err`` against ``F.linear``.

    python plugins/kernels_linear/benchmarks/bench_skinny.py [--rows 8 16 32 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from qllm.testing.benchmarking import compile_ahead, time_ms
from qllm_kernels_linear.testing import (QWEN3_0_6B_SHAPES, QWEN3_5_35B_A3B_SHAPES,
                                         linear_inputs)
from qllm_kernels_linear.triton_skinny import SkinnyConfig, default_config, skinny_gemm

DTYPE = torch.bfloat16
REP_MS = 15
MODELS = {"qwen3-0.6b": QWEN3_0_6B_SHAPES, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B_SHAPES}
GRID = dict(BLOCK_N=(16, 32, 64), BLOCK_K=(64, 128, 256), num_warps=(4,),
            num_stages=(3, 5), SPLIT_K=(1, 2, 4))


def bench(model: str, name: str, rows: int) -> dict:
    x, weight, _ = linear_inputs(rows, *MODELS[model][name], DTYPE, "cuda")
    n, k = weight.shape
    configs = [SkinnyConfig(*values) for values in itertools.product(*GRID.values())]
    rule = default_config(rows, n, k)
    configs += [rule] if rule not in configs else []
    calls = {config: functools.partial(skinny_gemm, x, weight, config=config)
             for config in configs}
    compile_ahead(calls.values())
    timed = []
    for config, call in calls.items():
        try:
            timed.append((time_ms(call, graph=True, rep=REP_MS), config))
        except Exception:  # noqa: BLE001 - a config the GPU cannot launch is skipped
            continue
    timed.sort(key=lambda item: item[0])
    best_ms, best = timed[0]
    cublas_ms = time_ms(functools.partial(F.linear, x, weight), graph=True, rep=REP_MS)
    rule_ms = next((ms for ms, config in timed if config == rule), None)
    reference = F.linear(x, weight).float()
    return dict(model=model, shape=name, rows=rows, n=n, k=k, cublas_us=round(1e3 * cublas_ms, 2),
                rule=dataclasses.asdict(rule),
                rule_us=None if rule_ms is None else round(1e3 * rule_ms, 2),
                best=dataclasses.asdict(best), us=round(1e3 * best_ms, 2),
                gbps=round(weight.numel() * weight.element_size() / best_ms / 1e6, 1),
                max_err=round((skinny_gemm(x, weight, config=best).float() - reference)
                              .abs().max().item(), 4),
                top=[dict(**dataclasses.asdict(c), us=round(1e3 * ms, 2)) for ms, c in timed[:5]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 16, 32, 64])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for model in args.models:
        for name in MODELS[model]:
            for rows in args.rows:
                print(json.dumps(bench(model, name, rows)), flush=True)


if __name__ == "__main__":
    main()
