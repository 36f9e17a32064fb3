"""The HBM read bandwidth this GPU reaches, by access pattern: the ceiling that the decode
rooflines in RESULTS.md should be measured against, and whether the expert GEMMs' row-major
weight tiles cost bandwidth that a tile-contiguous ("blocked") weight layout would recover.

Patterns, each over a 1 GiB bf16 buffer that does not fit in L2:
- ``stream``: each program sums a contiguous chunk (16-byte loads, no tensor cores);
- ``tiles``: the expert GEMM's weight stream, a ``[16, BK] x [BK, BN]`` ``tl.dot`` per K step
  over row-major ``[rows, 2048]`` weights (each step reads ``BN`` row pieces of ``2 * BK``
  bytes, 4 KiB apart);
- ``blocked``: the same GEMM over the same bytes laid out so that each K step's ``[BN, BK]``
  tile is one contiguous run;
- ``copy``: ``torch``'s device copy (read + write counted).

Times are medians of ``triton.testing.do_bench`` (L2 flushed between calls). Prints a table,
then one JSON object per row.

    python benchmarks/bench_bandwidth.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from qllm.testing.benchmarking import print_table, time_ms


BUFFER_BYTES = 1 << 30
HIDDEN = 2048  # the expert GEMM's reduction length (hidden size), as in Qwen3.5-35B-A3B
BLOCK_M = 16  # the decode tile's token rows


@triton.jit
def _stream_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """``out[p] = sum(x[p * CHUNK : (p + 1) * CHUNK])`` in fp32."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        acc += tl.load(x_ptr + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _tile_kernel(w_ptr, a_ptr, out_ptr, K: tl.constexpr, BLOCKED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[p] = a [BLOCK_M, K] @ w_p^T`` for weight tile ``p`` (``BLOCK_N`` rows of ``K``):
    row-major rows, or (``BLOCKED``) ``K / BLOCK_K`` contiguous ``[BLOCK_N, BLOCK_K]`` pieces."""
    pid = tl.program_id(0).to(tl.int64)
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    tile = w_ptr + pid * BLOCK_N * K
    if BLOCKED:
        w_ptrs = tile + ns[None, :] * BLOCK_K + ks[:, None]  # [BK, BN]
    else:
        w_ptrs = tile + ns[None, :] * K + ks[:, None]  # [BK, BN]
    a_ptrs = a_ptr + tl.arange(0, BLOCK_M)[:, None] * K + ks[None, :]  # [BM, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(w_ptrs), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_N * BLOCK_K if BLOCKED else BLOCK_K
    out_ptrs = out_ptr + pid * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + ns
    tl.store(out_ptrs, acc)


def row(pattern: str, config: str, ms: float, nbytes: int) -> dict:
    return dict(pattern=pattern, config=config, ms=round(ms, 4),
                tbps=round(nbytes / ms / 1e9, 3))


def stream_rows(buffer: torch.Tensor) -> list[dict]:
    rows = []
    for chunk, block, warps in itertools.product((1 << 15, 1 << 17), (2048, 8192), (4, 8)):
        out = torch.empty(buffer.numel() // chunk, device="cuda", dtype=torch.float32)
        ms = time_ms(lambda: _stream_kernel[(out.numel(),)](buffer, out, CHUNK=chunk,
                                                              BLOCK=block, num_warps=warps),
                     graph=False)
        rows.append(row("stream", f"chunk {chunk} block {block} warps {warps}", ms,
                        buffer.numel() * buffer.element_size()))
    return rows


def tile_rows(buffer: torch.Tensor) -> list[dict]:
    rows = []
    a = torch.randn(BLOCK_M, HIDDEN, device="cuda", dtype=buffer.dtype)
    for blocked, block_n, block_k, warps, stages in itertools.product(
            (False, True), (32, 64, 128), (128, 256), (4,), (3, 4)):
        tiles = buffer.numel() // (block_n * HIDDEN)
        out = torch.empty(tiles, BLOCK_M, block_n, device="cuda", dtype=torch.float32)
        ms = time_ms(lambda: _tile_kernel[(tiles,)](
            buffer, a, out, K=HIDDEN, BLOCKED=blocked, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages), graph=False)
        rows.append(row("blocked" if blocked else "tiles",
                        f"BN {block_n} BK {block_k} warps {warps} stages {stages}", ms,
                        buffer.numel() * buffer.element_size()))
    return rows


def main() -> None:
    buffer = torch.randn(BUFFER_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    rows = stream_rows(buffer) + tile_rows(buffer)
    target = torch.empty_like(buffer)
    rows.append(row("copy", "torch copy_ (read + write)",
                    time_ms(lambda: target.copy_(buffer), graph=False), 2 * BUFFER_BYTES))
    print_table(rows, [("pattern", "pattern", 9, None), ("config", "config", 34, None),
                       ("ms", "ms", 9, ".4f"), ("tbps", "TB/s", 7, ".3f")])


if __name__ == "__main__":
    main()
