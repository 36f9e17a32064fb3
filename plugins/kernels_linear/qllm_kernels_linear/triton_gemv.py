"""Triton GEMV: ``out [M, N] = x [M, K] @ weight[N, K]^T (+ bias)`` for ``M <= MAX_GEMV_ROWS``.

One program per ``BLOCK_N`` weight rows, no split over K: it walks K in ``BLOCK_K`` steps,
each step one contiguous ``BLOCK_K`` segment of each of its rows (16-byte loads, read once, the
``evict_first`` hint since no other program reads them) and the same columns of every ``x``
row. Products accumulate elementwise in a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` fp32 tile, reduced
over K once after the loop, so the loop has no cross-thread reduction. The tiles are indexed as
3-D pointers (``x`` as ``[BLOCK_M, 1, BLOCK_K]``, the weight as ``[1, BLOCK_N, BLOCK_K]``) so
the loads set the layout of the product (each thread holding all ``BLOCK_M`` rows of its
weight elements) instead of being converted into it (and with ``BLOCK_K = 256 * num_warps``,
see ``configs``, ``x``'s own load layout is the product's too). Bias is added in fp32 in the
epilogue; the output is rounded once to ``x.dtype``. The launch depends on shapes only (no
host sync).

Programmatic dependent launch (PDL), in small decode steps by the switch every plugin's
decode-path kernels share (``qllm.plugins.pdl``: on unless ``QLLM_PDL=0``), launches the kernel
with ``launch_pdl=True`` on Hopper and later GPUs, so its programs may start while the previous
kernel on the stream is still finishing (in a CUDA graph, a programmatic edge). Where the other
kernels enter through ``pdl_enter`` (launch dependents, then wait, before any memory access),
the GEMV, with ``USE_PDL``, first lets the next PDL-launched kernel launch
(``gdc_launch_dependents``), issues the loads of its first ``BLOCK_K`` weight columns
(parameters: no kernel of a decode step writes them), then waits for the previous kernel to
complete and its writes to be visible (``gdc_wait``) before it loads ``x`` (and the bias) or
stores anything: the first loop step is peeled for that, the loop runs the rest. Where that
step covers all of K (``WHOLE_K``) there is no loop, so no accumulator tile lives across one:
the kernel takes half the registers (64 instead of 123 at the GDN ``in_proj``'s 4 x 2,048
tile), and twice the programs are resident, their first tiles read, when the wait ends. At one row
``BLOCK_K`` covers all of ``K = 2048`` (the GDN ``in_proj``, ``qkv_proj``, the MoE
``input_proj``) and of ``K = 4096`` (``out_proj`` / ``o_proj``, two weight rows a program:
``configs``). The wait sits on the one path every thread runs (no branch before it), as PDL
requires of every PDL-launched kernel: the next one relies on it. Without ``USE_PDL`` the
constexpr prunes all of it and the kernel compiles to the same code as before the switch
existed. On an H200, in a CUDA graph of 80 GEMVs each fed by the one before, PDL saved 0.6 us
per kernel boundary; between kernels launched without it, it cost 1.5%
(``benchmarks/bench_pdl.py``, ``benchmarks/RESULTS.md``).

The contract PDL adds: the weight must not be written by work still in flight on the stream
(model parameters loaded before decoding qualify; a test that creates a weight on the GPU and
calls at once must synchronize first, as ``testing.linear_inputs`` does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qllm.plugins.pdl import launch_options, use_pdl
from qllm_kernels_linear.configs import MAX_GEMV_ROWS, GemvConfig, block_m, default_config
from qllm_kernels_linear.swept import swept_config

# N only bounds the rows, so a new N (divisible by 16 or not) needs no new compile.
@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_b, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 USE_PDL: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)      # [BN]
    offs_k = tl.arange(0, BLOCK_K)                                   # [BK]
    x_ptrs = (x_ptr + offs_m[:, None, None] * stride_xm
              + offs_k[None, None, :] * stride_xk)                   # [BM, 1, BK]
    w_ptrs = (w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])                               # [1, BN, BK]
    x_rows = offs_m[:, None, None] < M
    w_rows = offs_n[None, :, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if USE_PDL:  # the loop's first step, its weight loads issued before the wait
        gdc_launch_dependents()
        cols = offs_k[None, None, :] < K                             # [1, 1, BK]
        w = tl.load(w_ptrs, mask=w_rows & cols, other=0.0, eviction_policy="evict_first")
        gdc_wait()  # the previous kernel is done: x is written, out no longer read
        x = tl.load(x_ptrs, mask=x_rows & cols, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32) * w.to(tl.float32)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    if not (USE_PDL and WHOLE_K):  # (else the peeled step was all of K: no loop carries
        # the accumulator tile, and the kernel takes half the registers)
        for k in tl.range(BLOCK_K if USE_PDL else 0, K, BLOCK_K, num_stages=NUM_STAGES):
            cols = offs_k[None, None, :] < K - k                     # [1, 1, BK]
            x = tl.load(x_ptrs, mask=x_rows & cols, other=0.0, eviction_policy="evict_last")
            w = tl.load(w_ptrs, mask=w_rows & cols, other=0.0, eviction_policy="evict_first")
            acc += x.to(tl.float32) * w.to(tl.float32)               # [BM, BN, BK]
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=2)                                        # [BM, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_b, mask=offs_n < N, other=0.0)
        out += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def gpu_name(device: torch.device) -> str | None:
    """``torch.cuda.get_device_name`` of a CUDA ``device``; None for any other device."""
    if device.type != "cuda":
        return None
    return _gpu_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The launch config for ``m`` rows through a weight ``[n, k]`` on ``device``: the sweep's
    for this GPU and shape (``swept``), else the rule (``configs.default_config``)."""
    return swept_config(m, n, k, gpu_name(device)) or default_config(m, n, k)


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor, config: GemvConfig, pdl: bool) -> tuple[tuple, dict, dict]:
    """The kernel's launch for ``out [M, N] = x [M, K] @ weight [N, K]^T (+ bias)``: its grid,
    its arguments by name and its launch options (``launch_pdl`` only with ``pdl``, so a
    launch without PDL is the one before the switch)."""
    (m, k), n = x.shape, weight.shape[0]
    args = dict(x_ptr=x, w_ptr=weight, bias_ptr=bias, out_ptr=out, M=m, N=n, K=k,
                stride_xm=x.stride(0), stride_xk=x.stride(1), stride_wn=weight.stride(0),
                stride_b=0 if bias is None else bias.stride(0), stride_om=out.stride(0),
                HAS_BIAS=bias is not None, BLOCK_M=block_m(m), BLOCK_N=config.BLOCK_N,
                BLOCK_K=config.BLOCK_K, WHOLE_K=config.BLOCK_K >= k,
                NUM_STAGES=config.num_stages, USE_PDL=pdl)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages,
                   **launch_options(pdl))
    return (triton.cdiv(n, config.BLOCK_N),), args, options


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, pdl: bool | None = None) -> torch.Tensor:
    """``x [M, K]`` (any strides) @ ``weight [N, K]^T`` (rows contiguous: ``stride(1) == 1``)
    plus ``bias [N]`` -> ``out [M, N]`` in ``x.dtype``, for ``1 <= M <= MAX_GEMV_ROWS``;
    ``config`` overrides the sweep's config for this GPU and shape (``swept``), else the rule
    (``configs.default_config``). Inputs share one float dtype. ``pdl``
    (default: the ``QLLM_PDL`` switch, ``qllm.plugins.pdl.PDL``) launches with programmatic
    dependent launch where ``pdl_available`` (elsewhere, e.g. on the CPU under the interpreter,
    it is off); the weight must then not be written by work still in flight on the stream
    (module docstring)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_GEMV_ROWS:
        raise ValueError(f"gemv serves 1 to {MAX_GEMV_ROWS} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError(f"gemv needs contiguous weight rows, got strides {weight.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias of shape {tuple(bias.shape)} for {n} output features")
    config = config or gemv_config(m, n, k, x.device)
    pdl = use_pdl(x.device, m, pdl)
    out = x.new_empty(m, n)
    grid, args, options = gemv_launch(x, weight, bias, out, config, pdl)
    _gemv_kernel[grid](**args, **options)
    return out
