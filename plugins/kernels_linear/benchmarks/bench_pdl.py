"""Programmatic dependent launch (PDL, ``qllm.plugins.pdl``) for the GEMV, off against on.

A micro-benchmark: a CUDA graph of one decode step's GEMV chain at one row, replayed with PDL
off and on.

The chain is ``qllm_kernels_linear.testing.gemv_chain`` over ``--layers`` layers of
Qwen3.5-35B-A3B (default 40, as in a W3 step: three GDN layers then one attention layer, each
with its own weights, 2.6 GB in all, so every weight comes from HBM): per layer the RMS norm,
the ``in_proj`` GEMV (``[12352, 2048]``, or ``qkv_proj`` ``[9216, 2048]``), SiLU, ``out_proj``
(``[2048, 4096]``), the residual add, the norm, the MoE ``input_proj`` (``[264, 2048]``) and
its gate: each GEMV fed by the kernels before it, as in the decode step. ``--chain gemv`` runs
the GEMVs alone instead (``gemv_only_chain``: ``in_proj`` then ``out_proj``, each fed straight
by the GEMV before), where every kernel is PDL-launched: what PDL gains once every kernel of a
step takes part. Times are medians of ``triton.testing.do_bench`` over graph replays
(``qllm.testing.benchmarking.time_ms``, the L2 flushed before each), the median of ``--rounds``
timings taken in turn with the other impls (``spread``: their range); ``us`` per chain,
``layer_us`` per layer, ``gemv_gbps`` the GEMVs' weight bytes over the chain's time (the other
kernels' time included), ``vs_off`` the time against PDL off (below 1: PDL gains),
``same_bits`` whether the chain's output equals PDL off's bit for bit. ``cublas``
(``F.linear``) is there for scale. Prints a table, then one JSON object per row.

    python plugins/kernels_linear/benchmarks/bench_pdl.py [--layers 40] [--rounds 3]
        [--chain decode|gemv]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F

from qllm.plugins.pdl import pdl_available
from qllm.testing.benchmarking import print_table, time_ms
from qllm_kernels_linear.testing import (chain_layers, gemv_chain, gemv_only_chain,
                                         linear_inputs)
from qllm_kernels_linear.triton_gemv import gemv

CHAINS = {"decode": (gemv_chain, ("in_proj", "out_proj", "input_proj")),
          "gemv": (gemv_only_chain, ("in_proj", "out_proj"))}  # chain, its GEMVs per layer
COLUMNS = [("impl", "impl", 8, None), ("chain", "chain", 7, None), ("layers", "layers", 7, "d"),
           ("gemvs", "gemvs", 6, "d"), ("us", "us", 9, ".1f"), ("spread_us", "spread", 7, ".1f"),
           ("layer_us", "layer_us", 9, ".2f"),
           ("gemv_gbps", "GEMV GB/s", 10, ".0f"), ("vs_off", "vs_off", 7, ".3f"),
           ("same_bits", "same_bits", 10, None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timings per impl, interleaved; the median is reported")
    parser.add_argument("--chain", choices=CHAINS, default="decode",
                        help="decode: GEMVs between norms and elementwise ops, as in a step; "
                             "gemv: GEMVs alone")
    args = parser.parse_args()
    if not pdl_available(torch.device("cuda")):
        raise SystemExit("programmatic dependent launch needs a CUDA GPU of compute "
                         "capability 9.0 or later")
    layers = chain_layers(args.layers)
    hidden = linear_inputs(1, 1, 2048, device="cuda", seed=args.layers).x
    chain, projections = CHAINS[args.chain]
    weight_bytes = sum(getattr(layer, name).numel() * getattr(layer, name).element_size()
                       for layer in layers for name in projections)
    impls = {"pdl_off": functools.partial(gemv, pdl=False),
             "pdl_on": functools.partial(gemv, pdl=True), "cublas": F.linear}
    reference = chain(hidden, layers, impls["pdl_off"])
    calls = {impl: functools.partial(chain, hidden, layers, linear)
             for impl, linear in impls.items()}
    times = {impl: [] for impl in impls}
    for _ in range(args.rounds):  # interleaved, so a drift of the clocks hits every impl
        for impl, call in calls.items():
            times[impl].append(time_ms(call, graph=True))
    off_ms = statistics.median(times["pdl_off"])
    rows = []
    for impl, call in calls.items():
        ms = statistics.median(times[impl])
        rows.append(dict(impl=impl, chain=args.chain, layers=args.layers,
                         gemvs=len(projections) * args.layers,
                         us=round(1e3 * ms, 1), spread_us=round(1e3 * (max(times[impl])
                                                                      - min(times[impl])), 1),
                         layer_us=round(1e3 * ms / args.layers, 2),
                         gemv_gbps=round(weight_bytes / ms / 1e6), vs_off=round(ms / off_ms, 3),
                         same_bits=None if impl == "cublas"
                         else str(torch.equal(call(), reference))))
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
