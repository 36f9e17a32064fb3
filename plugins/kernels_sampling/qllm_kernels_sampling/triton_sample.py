"""Triton ``sample_tokens`` (contract and reference: ``qllm.ops.sampling``): every row's token
in one pass over its logits.

The reference writes the fp32 scaled logits, their softmax, an ``Exp(1)`` noise tensor and their
quotient before its argmax: at W1's batch of 256 rows of 151,936 logits, about 1.3 GB of
memory traffic in some eight kernels per step (851 us on an H100). Here each program reads
``CHUNK`` logits of one row once, draws their noise in registers (Philox, ``tl.randint4x``:
four uniforms per counter) and keeps two running maxima per lane, the race's and the greedy
argmax's:

    score = logits / T - log(-log(u)),   u ~ U(0, 1)

the Gumbel-max form of the reference's exponential race (``-log(u) ~ Exp(1)``; ``argmax(p /
q)`` is ``argmax(log p - log q)``, and ``log p`` is ``logits / T`` up to the row's constant).
Each program stores its chunk's two maxima and their columns; a second kernel, one program
per row, picks the row's (the race's where its temperature is above 0, else the greedy one).
Ties keep the first column (a lane replaces its maximum only by a larger one, and maxima go
to the smallest column among equals), so a row at temperature 0 gets ``torch.argmax``'s
token. Logits of ``-inf`` score ``-inf`` and are never drawn. On CUDA the logs are the
approximate ``lg2.approx`` ones (noise needs no more; 1.8x faster at 256 rows).

The noise of element ``(row, column)`` is Philox's output at counter ``(column // 4's lane,
row)`` under ``seed``: the same seed, shapes and logits give the same tokens, however the
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
# approximate log. The reference op: 851 at 256 rows.
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
def _race_step(row_ptr, columns, vocab, inverse_temperature, uniform, best, best_at, top,
               top_at, FAST_LOG: tl.constexpr):
    """One lane vector's step: the columns' scores against the running maxima ``best`` (the
    race) and ``top`` (the greedy argmax), with their columns."""
    logits = tl.load(row_ptr + columns, mask=columns < vocab,
                     other=float("-inf")).to(tl.float32)  # [BLOCK]
    score = logits * inverse_temperature - _log(-_log(uniform, FAST_LOG), FAST_LOG)
    better = score > best
    best = tl.where(better, score, best)
    best_at = tl.where(better, columns, best_at)
    higher = logits > top
    top = tl.where(higher, logits, top)
    top_at = tl.where(higher, columns, top_at)
    return best, best_at, top, top_at


@triton.jit
def _first_maximum(values, columns, vocab):
    """The smallest column whose value is the largest."""
    largest = tl.max(values, axis=0)
    return tl.min(tl.where(values == largest, columns, vocab), axis=0)


@triton.jit(do_not_specialize=["seed", "vocab", "stride_row"])
def _race_chunk_kernel(logits_ptr, temperature_ptr, best_ptr, best_at_ptr, top_ptr, top_at_ptr,
                       seed, vocab, stride_row, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       FAST_LOG: tl.constexpr):
    """Program ``(row, chunk)``: the race's and the greedy maxima of the row's ``CHUNK``
    columns from ``chunk * CHUNK``, and their columns, into ``[N, chunks]`` buffers."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    temperature = tl.load(temperature_ptr + row)
    inverse_temperature = 1.0 / tl.where(temperature > 0, temperature, 1.0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    counters = (row.to(tl.int64) << 32) + lanes  # [BLOCK]: the row in the high word
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.zeros((BLOCK,), tl.int32)
    top_at = tl.zeros((BLOCK,), tl.int32)
    for start in tl.range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * BLOCK):
        bits = tl.randint4x(seed, counters + start // 4)  # four [BLOCK] int32 blocks
        for part in tl.static_range(4):
            best, best_at, top, top_at = _race_step(
                row_ptr, start + part * BLOCK + lanes, vocab, inverse_temperature,
                tl.random.uint_to_uniform_float(bits[part]), best, best_at, top, top_at,
                FAST_LOG)
    out = row * chunks + chunk
    best_max = tl.max(best, axis=0)
    tl.store(best_ptr + out, best_max)
    tl.store(best_at_ptr + out, _first_maximum(best, best_at, vocab))
    tl.store(top_ptr + out, tl.max(top, axis=0))
    tl.store(top_at_ptr + out, _first_maximum(top, top_at, vocab))


@triton.jit
def _race_final_kernel(temperature_ptr, best_ptr, best_at_ptr, top_ptr, top_at_ptr, out_ptr,
                       vocab, chunks, CHUNKS: tl.constexpr):
    """Program ``row``: the first maximum over the row's chunks (the race's where the
    temperature is above 0, else the greedy one) -> ``out[row]``."""
    row = tl.program_id(0)
    offsets = row * chunks + tl.arange(0, CHUNKS)
    mask = tl.arange(0, CHUNKS) < chunks
    if tl.load(temperature_ptr + row) > 0:
        values = tl.load(best_ptr + offsets, mask=mask, other=float("-inf"))
        columns = tl.load(best_at_ptr + offsets, mask=mask, other=vocab)
    else:
        values = tl.load(top_ptr + offsets, mask=mask, other=float("-inf"))
        columns = tl.load(top_at_ptr + offsets, mask=mask, other=vocab)
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
    temperature = temperature.contiguous()
    best, top = (logits.new_empty(rows, chunks, dtype=torch.float32) for _ in range(2))
    best_at, top_at = (logits.new_empty(rows, chunks, dtype=torch.int32) for _ in range(2))
    _race_chunk_kernel[(rows, chunks)](
        logits, temperature, best, best_at, top, top_at, seed % SEED_TOP_BIT | SEED_TOP_BIT,
        vocab, logits.stride(0), CHUNK=chunk, BLOCK=block, FAST_LOG=logits.is_cuda,
        num_warps=NUM_WARPS)
    _race_final_kernel[(rows,)](temperature, best, best_at, top, top_at, out, vocab, chunks,
                                CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return out
