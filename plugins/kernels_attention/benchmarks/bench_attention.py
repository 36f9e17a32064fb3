"""Micro-benchmark of the Triton paged-attention kernels against the plain-torch reference.

Qwen3-0.6B attention (16 query heads, 8 kv heads, head_dim 128, bf16) on pages of 256 tokens:
decode at batch 1/16/64/256 x context 512/2048, prefill of 8k new tokens (one sequence
from scratch, and four 2k chunks after 2k cached tokens each), and the K/V store of 1, 256
and 16,384 new tokens (``--kinds`` picks among the three). Times are medians of
``triton.testing.do_bench`` (L2 flushed between calls). Decode runs in CUDA graphs in the
engine, so its ``ms`` is a graph replay (``eager_ms``: plain calls, CPU launch cost included);
prefill runs eagerly (a store of 256 tokens or fewer is a decode step's: graph replays). GB/s
counts the bytes a call must move at least (every cached K/V once, q, out; a store reads and
writes each new K/V row once) against the H200's ~4.3 TB/s; ``max_err`` is the largest
difference from the reference. Prints a table, then one JSON object per row.

    python plugins/kernels_attention/benchmarks/bench_attention.py \
        [--page 256] [--impl triton torch] [--kinds decode prefill store]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from qllm.ops import attention
from qllm.testing.benchmarking import graphed, print_table
from qllm_kernels_attention import ops
from qllm_kernels_attention.testing import PagedInputs, paged_inputs

Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.bfloat16
PEAK_GBPS = 4300.0
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048)
PREFILLS = {  # name -> (new tokens per sequence, cached tokens per sequence, sequences)
    "prefill 1x8192": (8192, 0, 1),
    "chunked 4x2048+2048": (2048, 2048, 4),
}
STORE_TOKENS = (1, 256, 16384)
GRAPHED_STORE_TOKENS = 256  # up to this many new tokens a store is a decode step's
IMPLS = {
    "decode": {"triton": ops.paged_attention_decode, "torch": attention.paged_attention_decode},
    "prefill": {"triton": ops.paged_attention_prefill,
                "torch": attention.paged_attention_prefill},
}
STORES = {"triton": ops.kv_store, "torch": attention.kv_store}


def traffic(x: PagedInputs) -> tuple[int, int]:
    """(bytes, flops) of one call: each cached token's K and V read once, q read, out written;
    two matmuls per visible (query, key) pair."""
    b = x.batch
    itemsize = x.q.element_size()
    kv_bytes = sum(b.seq_lens_host) * KV_HEADS * HEAD_DIM * 2 * itemsize
    qo_bytes = 2 * x.q.numel() * itemsize
    pairs = sum(q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
                for q_len, seq_len in zip(b.query_lens_host, b.seq_lens_host))
    return kv_bytes + qo_bytes, 4 * pairs * Q_HEADS * HEAD_DIM


def measure(kind: str, name: str, x: PagedInputs, impls: list[str]) -> list[dict]:
    nbytes, flops = traffic(x)
    reference = None
    rows = []
    for impl in impls:
        fn = IMPLS[kind][impl]

        def call():
            return fn(x.q, x.k_cache, x.v_cache, x.batch, x.scale)

        out = call()
        if reference is None:
            reference = IMPLS[kind]["torch"](x.q, x.k_cache, x.v_cache, x.batch, x.scale)
        eager_ms = do_bench(call, return_mode="median")
        ms = do_bench(graphed(call), return_mode="median") if kind == "decode" else eager_ms
        gbps = nbytes / ms / 1e6
        rows.append(dict(kind=kind, case=name, impl=impl, batch=x.batch.num_seqs,
                         new_tokens=x.q.shape[0], context=max(x.batch.seq_lens_host),
                         ms=round(ms, 4), eager_ms=round(eager_ms, 4), gbps=round(gbps, 1),
                         pct_peak_bw=round(100 * gbps / PEAK_GBPS, 1),
                         tflops=round(flops / ms / 1e9, 1),
                         max_err=round((out.float() - reference.float()).abs().max().item(), 4)))
    return rows


def measure_store(tokens: int, page: int, impls: list[str]) -> list[dict]:
    """The K/V store of ``tokens`` new rows (each sequence's next token, or one sequence's
    prompt) through each of ``impls``; ``max_err`` against the torch store's caches."""
    if tokens > GRAPHED_STORE_TOKENS:
        x = paged_inputs([tokens], [0], Q_HEADS, KV_HEADS, HEAD_DIM, page, DTYPE, "cuda")
    else:
        x = paged_inputs([1] * tokens, [0] * tokens, Q_HEADS, KV_HEADS, HEAD_DIM, page, DTYPE,
                         "cuda")
    slot_mapping = x.batch.caches["paged_kv"].slot_mapping
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(2))
    expected = [c.clone() for c in (x.k_cache, x.v_cache)]
    STORES["torch"](*expected, k, v, slot_mapping)
    nbytes = 2 * 2 * k.numel() * k.element_size()
    rows = []
    for impl in impls:
        def call():
            STORES[impl](x.k_cache, x.v_cache, k, v, slot_mapping)

        call()
        max_err = max((c - e).abs().max().item()
                      for c, e in zip((x.k_cache, x.v_cache), expected))
        eager_ms = do_bench(call, return_mode="median")
        ms = do_bench(graphed(call), return_mode="median") if tokens <= GRAPHED_STORE_TOKENS \
            else eager_ms
        gbps = nbytes / ms / 1e6
        rows.append(dict(kind="store", case=f"store {tokens}", impl=impl, new_tokens=tokens,
                         ms=round(ms, 4), eager_ms=round(eager_ms, 4), gbps=round(gbps, 1),
                         pct_peak_bw=round(100 * gbps / PEAK_GBPS, 1), max_err=max_err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=int, default=256, help="page (block) size in tokens")
    parser.add_argument("--impl", nargs="+", default=["triton", "torch"],
                        choices=["triton", "torch"])
    parser.add_argument("--kinds", nargs="+", default=["decode", "prefill", "store"],
                        choices=["decode", "prefill", "store"])
    args = parser.parse_args()

    rows = []
    for context in DECODE_CONTEXTS if "decode" in args.kinds else ():
        for batch in DECODE_BATCHES:
            x = paged_inputs([1] * batch, [context - 1] * batch, Q_HEADS, KV_HEADS, HEAD_DIM,
                             args.page, DTYPE, "cuda")
            rows += measure("decode", f"decode b{batch} ctx{context}", x, args.impl)
    for name, (new, cached, seqs) in PREFILLS.items() if "prefill" in args.kinds else ():
        x = paged_inputs([new] * seqs, [cached] * seqs, Q_HEADS, KV_HEADS, HEAD_DIM,
                         args.page, DTYPE, "cuda")
        rows += measure("prefill", name, x, args.impl)
    for tokens in STORE_TOKENS if "store" in args.kinds else ():
        rows += measure_store(tokens, args.page, args.impl)

    print_table(rows, [("case", "case", 24, None), ("impl", "impl", 8, None),
                       ("ms", "ms", 9, ".4f"), ("eager_ms", "eager_ms", 10, ".4f"),
                       ("gbps", "GB/s", 9, ".1f"), ("pct_peak_bw", "%peak", 7, ".1f"),
                       ("tflops", "TFLOP/s", 9, ".1f"), ("max_err", "max_err", 9, ".4f")])


if __name__ == "__main__":
    main()
