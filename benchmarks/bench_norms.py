"""Micro-benchmark of the fused norm kernels against their plain-torch references: the gated
RMSNorm closing a Gated DeltaNet layer (``rms_norm_gated``, plugin ``kernels_gdn``), the
attention layers' q/k norm + RoPE (``qk_norm_rope``, plugin ``kernels_attention``) and the
residual add + RMSNorm before the projections (``add_rms_norm``, plugin ``kernels_linear``;
``add_rms_norm_moe``: the same op after an MoE block, summing its 9 per-slot outputs).

Qwen3.5-35B-A3B shapes (bf16): 32 value heads x 128 for the gated norm; 16 query and 2 key
heads x 256 with 64 rotary dims and zero-centred weights for q/k; the 2,048-wide residual
stream with a zero-centred weight for the add + norm; at 1 token (W3's decode),
200 (W2's decode) and 16,384 (a prefill step). ``triton`` is the plugin's kernel, ``compiled``
the reference under ``torch.compile`` (what the decode graphs ran before the kernels: Inductor's
fusion of it), ``torch`` the eager reference. Times are medians of ``triton.testing.do_bench``
(L2 flushed between calls), decode sizes as CUDA-graph replays, the prefill size eagerly. GB/s
counts the activations read and written once against the H200's ~4.3 TB/s; ``max_err`` is the
largest difference from the eager reference. Prints a table, then one JSON object per row.

    python benchmarks/bench_norms.py [--impl triton compiled torch] [--tokens 1 200 16384]
"""

from __future__ import annotations

import argparse

import torch

from qllm.ops import norm, rope
from qllm.testing.benchmarking import print_table, time_ms
from qllm_kernels_attention import ops as attention_ops
from qllm_kernels_attention.testing import qk_inputs
from qllm_kernels_gdn import ops as gdn_ops
from qllm_kernels_gdn.testing import norm_inputs
from qllm_kernels_linear import ops as linear_ops
from qllm_kernels_linear.testing import norm_inputs as add_norm_inputs

DTYPE = torch.bfloat16
PEAK_GBPS = 4300.0
GRAPH_MAX_TOKENS = 256  # decode sizes run as CUDA-graph replays
QK_GEOMETRY = dict(q_heads=16, k_heads=2, head_dim=256, rotary_dim=64, zero_centered=True)
V_HEADS, V_DIM = 32, 128
HIDDEN = 2048
MOE_SLOTS = 9  # Qwen3.5-35B-A3B's top-8 plus the shared expert
REFERENCES = {"rms_norm_gated": norm.rms_norm_gated, "qk_norm_rope": rope.qk_norm_rope,
              "add_rms_norm": norm.add_rms_norm, "add_rms_norm_moe": norm.add_rms_norm}
KERNELS = {"rms_norm_gated": gdn_ops.rms_norm_gated, "qk_norm_rope": attention_ops.qk_norm_rope,
           "add_rms_norm": linear_ops.add_rms_norm, "add_rms_norm_moe": linear_ops.add_rms_norm}


def case(op: str, tokens: int) -> tuple[tuple, int]:
    """One call's arguments and the bytes it moves at least (inputs read, outputs written)."""
    if op == "rms_norm_gated":
        x, gate, weight = norm_inputs(tokens, V_HEADS, V_DIM, DTYPE, "cuda")
        return (x, gate, weight, 1e-6), 3 * x.numel() * x.element_size()
    if op in ("add_rms_norm", "add_rms_norm_moe"):
        parts = MOE_SLOTS if op == "add_rms_norm_moe" else 0
        x, residual, weight = add_norm_inputs(tokens, HIDDEN, DTYPE, "cuda", zero_centered=True,
                                              parts=parts)
        return (x, residual, weight, 1e-6, True), \
            (x.numel() + 3 * residual.numel()) * x.element_size()
    args = qk_inputs(**QK_GEOMETRY, tokens=tokens, dtype=DTYPE, device="cuda")
    q, k = args[:2]
    return args, 2 * (q.numel() + k.numel()) * q.element_size()


def measure(op: str, tokens: int, impls: list[str]) -> list[dict]:
    args, nbytes = case(op, tokens)
    expected = REFERENCES[op](*args)
    functions = {"triton": KERNELS[op], "torch": REFERENCES[op],
                 "compiled": torch.compile(REFERENCES[op], fullgraph=True)}
    rows = []
    for impl in impls:
        fn = functions[impl]
        out = fn(*args)
        ms = time_ms(lambda: fn(*args), graph=tokens <= GRAPH_MAX_TOKENS)
        outs, refs = ((out, expected) if isinstance(out, tuple) else ((out,), (expected,)))
        max_err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs))
        gbps = nbytes / ms / 1e6
        rows.append(dict(op=op, tokens=tokens, impl=impl, us=round(1000 * ms, 2),
                         gbps=round(gbps, 1), pct_peak_bw=round(100 * gbps / PEAK_GBPS, 1),
                         max_err=round(max_err, 4)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["triton", "compiled", "torch"],
                        choices=["triton", "compiled", "torch"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 200, 16384])
    args = parser.parse_args()
    rows = [row for op in REFERENCES for tokens in args.tokens
            for row in measure(op, tokens, args.impl)]
    print_table(rows, [("op", "op", 17, None), ("tokens", "tokens", 7, "d"),
                       ("impl", "impl", 9, None), ("us", "us", 9, ".2f"),
                       ("gbps", "GB/s", 9, ".1f"), ("pct_peak_bw", "%peak", 7, ".1f"),
                       ("max_err", "max_err", 9, ".4f")])


if __name__ == "__main__":
    main()
