"""Triton ``sample_tokens`` (contract and reference: ``qllm.ops.sampling``): every row's token
in one pass over its logits.

The reference writes the fp32 scaled logits, their softmax, an ``Exp(1)`` noise tensor and their
quotient before its argmax: at W1's batch of 256 rows of 151,936 logits, about 1.3 GB of
memory traffic in some eight kernels per step (851 us on an H100). Here each program reads
``CHUNK`` logits of one row once, draws their noise in registers (Philox, ``tl.randint4x``:
four uniforms per counter) and keeps each lane's running maximum of

    score = logits / T - log(-log(u)),   u ~ U(0, 1)

the Gumbel-max form of the reference's exponential race (``-log(u) ~ Exp(1)``; ``argmax(p /
q)`` is ``argmax(log p - log q)``, and ``log p`` is ``logits / T`` up to the row's constant).
A row at temperature 0 takes the logits themselves (no noise). Each program stores its
chunk's maximum and its column; a second kernel, one program per row, picks the row's.
Ties keep the first column (a lane replaces its maximum only by a larger one, and maxima go
to the smallest column among equals), so a row at temperature 0 gets ``torch.argmax``'s
token. Logits of ``-inf`` score ``-inf`` and are never drawn. On CUDA the logs are the
approximate ``lg2.approx`` ones (noise needs no more; 1.8x faster at 256 rows).

The noise of element ``(row, column)`` is one of Philox's four outputs under ``seed`` at a
counter made of the row and the column (``start / 4 + lane`` for ``column = start + part *
BLOCK + lane``): the same seed, shapes and logits give the same tokens, however the
columns are split, and rows draw independent noise. The launches depend on shapes only; the
sampler calls them eagerly, after the step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Measured on an H100 at 151,936 logits per row (2026-12-06; us at 256 / 64 / 8 / 1 rows): one
# program per row took 136-175 / 72-185 / 71-183 / 70-140 over lane vectors of 256 to 2,048 and
# 2 to 16 warps (a row's columns walked by one program, latency-bound); split over programs of
# 2 loop steps, 147.2 / 43.4 / 14.7 / 10.9 with tl.log, 82.7 / 28.5 / 12.7 / 11.5 with the
# approximate log (a form that also kept each row's greedy maximum; this one, timed in W1 only:
# 19,595.9 vs 18,402.9 tok/s with the reference's draws). The reference op: 851 at 256 rows.
MAX_BLOCK = 256  # logits per lane vector (fewer for a vocabulary under 4 * 256); a loop step
# covers 4 lane vectors
STEPS_PER_PROGRAM = 2  # loop steps per program: a row's columns split over programs
NUM_WARPS = 4
SEED_TOP_BIT = 1 << 62  # set in every seed: Triton then always passes it as int64 (one variant)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """``log(x)``: CUDA's approximate ``__nv_fast_logf`` (``lg2.approx``) with ``FAST_LOG``
    (the Triton interpreter has no libdevice), else ``tl.log``."""
    if FAST_LOG:
        return libdevice.fast_logf(x)
    return tl.log(x)


@triton.jit
def _load_logits(row_ptr, columns, vocab):
    """The row's logits at ``columns`` in fp32, ``-inf`` past the vocabulary."""
    return tl.load(row_ptr + columns, mask=columns < vocab, other=float("-inf")).to(tl.float32)


@triton.jit
def _keep_larger(values, columns, best, best_at):
    """The lanes' running maxima ``best`` (and their columns): replaced only by a larger
    value, so a lane keeps its first column among equals."""
    larger = values > best
    return tl.where(larger, values, best), tl.where(larger, columns, best_at)


@triton.jit
def _first_maximum(values, columns, vocab):
    """The smallest column whose value is the largest."""
    largest = tl.max(values, axis=0)
    return tl.min(tl.where(values == largest, columns, vocab), axis=0)


@triton.jit(do_not_specialize=["seed", "vocab", "stride_row"])
def _chunk_maximum_kernel(logits_ptr, temperature_ptr, best_ptr, best_at_ptr, seed, vocab,
                          stride_row, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          FAST_LOG: tl.constexpr):
    """Program ``(row, chunk)``: over the row's ``CHUNK`` columns from ``chunk * CHUNK``, the
    maximum score (``logits / T - log(-log(u))``, or the logits where ``T`` is 0) and its
    first column, into ``best`` / ``best_at [N, chunks]``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.zeros((BLOCK,), tl.int32)
    if temperature > 0:
        inverse_temperature = 1.0 / temperature
        counters = (row.to(tl.int64) << 32) + lanes  # [BLOCK]: the row in the high word
        for start in tl.range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * BLOCK):
            bits = tl.randint4x(seed, counters + start // 4)  # four [BLOCK] int32 blocks
            for part in tl.static_range(4):
                columns = start + part * BLOCK + lanes
                uniform = tl.random.uint_to_uniform_float(bits[part])
                score = (_load_logits(row_ptr, columns, vocab) * inverse_temperature
                         - _log(-_log(uniform, FAST_LOG), FAST_LOG))
                best, best_at = _keep_larger(score, columns, best, best_at)
    else:
        for start in tl.range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            columns = start + lanes
            best, best_at = _keep_larger(_load_logits(row_ptr, columns, vocab), columns, best,
                                         best_at)
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, tl.max(best, axis=0))
    tl.store(best_at_ptr + out, _first_maximum(best, best_at, vocab))


@triton.jit
def _row_maximum_kernel(best_ptr, best_at_ptr, out_ptr, vocab, chunks, CHUNKS: tl.constexpr):
    """Program ``row``: the first maximum over the row's chunks -> ``out[row]``."""
    row = tl.program_id(0)
    offsets = row * chunks + tl.arange(0, CHUNKS)
    mask = tl.arange(0, CHUNKS) < chunks
    values = tl.load(best_ptr + offsets, mask=mask, other=float("-inf"))
    columns = tl.load(best_at_ptr + offsets, mask=mask, other=vocab)
    tl.store(out_ptr + row, _first_maximum(values, columns, vocab).to(tl.int64))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """``logits [N, V]`` (unit column stride, any float dtype), ``temperature [N]`` fp32 and an
    integer ``seed`` -> ``[N]`` int64: the ``sample_tokens`` op (``qllm.ops.sampling``). Only
    the seed's low 62 bits count."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"sample_tokens: logits [N, V] with unit column stride expected, got "
                         f"shape {tuple(logits.shape)}, strides {logits.stride()}")
    if temperature.shape != logits.shape[:1] or temperature.dtype != torch.float32:
        raise ValueError(f"sample_tokens: temperature [{logits.shape[0]}] fp32 expected, got "
                         f"{tuple(temperature.shape)} {temperature.dtype}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(-(-vocab // 4)))
    chunk = 4 * block * STEPS_PER_PROGRAM
    chunks = triton.cdiv(vocab, chunk)
    best = logits.new_empty(rows, chunks, dtype=torch.float32)
    best_at = logits.new_empty(rows, chunks, dtype=torch.int32)
    _chunk_maximum_kernel[(rows, chunks)](
        logits, temperature.contiguous(), best, best_at, seed % SEED_TOP_BIT | SEED_TOP_BIT,
        vocab, logits.stride(0), CHUNK=chunk, BLOCK=block, FAST_LOG=logits.is_cuda,
        num_warps=NUM_WARPS)
    _row_maximum_kernel[(rows,)](best, best_at, out, vocab, chunks,
                                 CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return out
