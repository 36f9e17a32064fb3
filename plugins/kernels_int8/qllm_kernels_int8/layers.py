"""The modules the 8-bit formats swap in: linears (for qllm's ``Linear`` family) and routed
experts (for modules in the ``fused_moe`` contract), each holding 8-bit weights and their
scales.

A quantized linear keeps the full-precision module it replaces as its *layout* (not a
submodule, and stripped of its weight): ``split``, ``shard_offsets`` and where each
checkpoint shard's rows go (``qllm.model.quantization.row_runs``) come from it, so packed
projections (q/k/v, gate/up, the GDN input projection, Qwen3-Next's rows grouped per key
head) load and split as before. The bias stays full precision.

Loading quantizes each checkpoint tensor as it arrives (a full-precision tensor), or places
an fp8 checkpoint's weight and scale (``Fp8Block``, paired by ``formats.Fp8Format``) as they
are. FP8 block scales span 128 rows: where a shard's rows do not own whole blocks (a shard
that starts or ends inside a block shared with another shard), the shared blocks are
dequantized, merged and quantized again with one scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qllm.layers.linear import default_weight_loader
from qllm.model.quantization import row_runs

from qllm_kernels_int8.quant import (FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks,
                                     quantize_int8_rows)


class Fp8Block(NamedTuple):
    """An fp8 checkpoint tensor with its ``weight_scale_inv``: ``q [N, K]``, ``scale_inv
    [ceil(N/bn), ceil(K/bk)]``."""

    q: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


# ----------------------------------------------------------------------------- row storage


class Int8Rows:
    """Placing rows into ``weight [N, K] int8`` and ``scale [N]``."""

    @staticmethod
    def place(weight: torch.Tensor, scale: torch.Tensor, loaded: torch.Tensor,
              runs: list[tuple[int, int, int]]) -> None:
        q, s = quantize_int8_rows(loaded)
        for src, dst, n in runs:
            weight[dst:dst + n] = q[src:src + n]
            scale[dst:dst + n] = s[src:src + n]


class Fp8Rows:
    """Placing rows into ``weight [N, K] e4m3`` and ``scale_inv [ceil(N/bn), ceil(K/bk)]``
    (both zeroed before loading, so a merge reads unloaded rows as 0)."""

    @staticmethod
    def place(weight: torch.Tensor, scale: torch.Tensor, loaded, block: tuple[int, int],
              runs: list[tuple[int, int, int]]) -> None:
        bn = block[0]
        total = weight.shape[0]
        source_rows = loaded.shape[0]
        full = None  # the loaded rows in fp32, made on the first run that needs them
        for src, dst, n in runs:
            owns = (dst % bn == 0 and ((dst + n) % bn == 0 or dst + n == total))
            if (isinstance(loaded, Fp8Block) and tuple(loaded.block) == tuple(block) and owns
                    and src % bn == 0 and ((src + n) % bn == 0 or src + n == source_rows)):
                weight[dst:dst + n] = loaded.q[src:src + n]
                scale[dst // bn:-(-(dst + n) // bn)] = \
                    loaded.scale_inv[src // bn:-(-(src + n) // bn)].float()
                continue
            if full is None:
                full = (dequantize_fp8_blocks(loaded.q, loaded.scale_inv, loaded.block)
                        if isinstance(loaded, Fp8Block) else loaded.float())
            first, last = dst // bn, -(-(dst + n) // bn)  # the blocks the run touches
            r0, r1 = first * bn, min(last * bn, total)
            rows = dequantize_fp8_blocks(weight[r0:r1], scale[first:last], block)
            rows[dst - r0:dst - r0 + n] = full[src:src + n]
            q, s = quantize_fp8_blocks(rows, block)
            weight[r0:r1] = q
            scale[first:last] = s


def zero_fp8_(weight: torch.Tensor) -> None:
    weight.view(torch.uint8).zero_()


# ----------------------------------------------------------------------------- linears


class QuantizedLinear(nn.Module):
    """Base of the 8-bit linears: ``weight [N, K]`` (8-bit), scales, and the replaced
    full-precision module as the layout (see the module docstring)."""

    def __init__(self, layout: nn.Module):
        super().__init__()
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.bias = layout.bias  # full precision (or None)
        del layout.weight
        layout.bias = None
        object.__setattr__(self, "_layout", layout)  # not a submodule: no parameters

    @property
    def shard_offsets(self):
        return getattr(self._layout, "shard_offsets", None)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return self._layout.split(out)

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        if param is self.bias:
            if shard is None:
                default_weight_loader(param, loaded)
            else:
                offset, size = self._layout.shard_offsets[shard]
                default_weight_loader(param.data.narrow(0, offset, size), loaded)
            return
        if loaded.shape[-1] != self.in_features or (
                shard is None and loaded.shape[0] != self.out_features):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                             f"{(self.out_features, self.in_features)}")
        self.place(loaded, row_runs(self._layout, shard, loaded.shape[0], self.out_features))

    def place(self, loaded, runs: list[tuple[int, int, int]]) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"layout={type(self._layout).__name__}")


class Int8Linear(QuantizedLinear):
    """``weight [N, K] int8`` and ``weight_scale [N] fp32`` (a buffer: derived at load),
    computed by the ``linear_w8a16`` op."""

    def __init__(self, layout: nn.Module, kernels):
        super().__init__(layout)
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               dtype=torch.int8), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(self.out_features))
        self._linear = kernels.linear_w8a16

    def place(self, loaded, runs) -> None:
        if isinstance(loaded, Fp8Block):
            loaded = dequantize_fp8_blocks(loaded.q, loaded.scale_inv, loaded.block)
        Int8Rows.place(self.weight.data, self.weight_scale, loaded, runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.weight_scale, self.bias)


class Fp8Linear(QuantizedLinear):
    """``weight [N, K] e4m3`` and ``weight_scale_inv [ceil(N/bn), ceil(K/bk)] fp32`` (a
    buffer: filled with the weight), computed by the ``linear_fp8_block`` op."""

    def __init__(self, layout: nn.Module, kernels, block: tuple[int, int]):
        super().__init__(layout)
        self.block = tuple(block)
        bn, bk = self.block
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               dtype=FP8_DTYPE), requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(
            -(-self.out_features // bn), -(-self.in_features // bk)))
        self._linear = kernels.linear_fp8_block

    def reset_derived_buffers(self) -> None:
        zero_fp8_(self.weight.data)
        self.weight_scale_inv.zero_()

    def place(self, loaded, runs) -> None:
        Fp8Rows.place(self.weight.data, self.weight_scale_inv, loaded, self.block, runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.weight_scale_inv, self.bias, *self.block)


# ----------------------------------------------------------------------------- experts


class QuantizedExpertWeight(nn.Module):
    """One projection of every expert, ``weight [E, R, C]`` 8-bit plus scales, loading like
    the ``StackedExpertWeight`` it replaces: whole, or per expert as shard ``"{part}:{e}"``
    (``layout.shard_offsets``: ``(expert, first row)``, ``layout.rows`` rows)."""

    def __init__(self, layout: nn.Module, fmt: str, block: tuple[int, int] | None = None):
        super().__init__()
        experts, rows, cols = layout.weight.shape
        self.rows, self.shard_offsets, self.fmt = layout.rows, layout.shard_offsets, fmt
        if fmt == "int8":
            self.weight = nn.Parameter(torch.empty(experts, rows, cols, dtype=torch.int8),
                                       requires_grad=False)
            self.register_buffer("scale", torch.empty(experts, rows))
        else:
            self.block = tuple(block)
            self.weight = nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8_DTYPE),
                                       requires_grad=False)
            self.register_buffer("scale", torch.empty(experts, -(-rows // block[0]),
                                                      -(-cols // block[1])))

    def reset_derived_buffers(self) -> None:
        if self.fmt != "int8":
            zero_fp8_(self.weight.data)
            self.scale.zero_()

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        if shard is None:
            if tuple(loaded.shape) != tuple(self.weight.shape):
                raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                                 f"{tuple(self.weight.shape)}")
            for e in range(self.weight.shape[0]):
                part = (Fp8Block(loaded.q[e], loaded.scale_inv[e], loaded.block)
                        if isinstance(loaded, Fp8Block) else loaded[e])
                self._place(e, part, [(0, 0, self.weight.shape[1])])
            return
        expert, offset = self.shard_offsets[shard]
        if tuple(loaded.shape) != (self.rows, self.weight.shape[2]):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                             f"{(self.rows, self.weight.shape[2])}")
        self._place(expert, loaded, [(0, offset, self.rows)])

    def _place(self, expert: int, loaded, runs) -> None:
        if self.fmt == "int8":
            if isinstance(loaded, Fp8Block):
                loaded = dequantize_fp8_blocks(loaded.q, loaded.scale_inv, loaded.block)
            Int8Rows.place(self.weight.data[expert], self.scale[expert], loaded, runs)
        else:
            Fp8Rows.place(self.weight.data[expert], self.scale[expert], loaded, self.block,
                          runs)


class QuantizedExperts(nn.Module):
    """The routed experts of an MoE block in an 8-bit format, in the ``fused_moe`` contract
    (``forward(x, topk_weights, topk_ids, shared_w13, shared_w2)``; ``routed(x, topk_weights,
    topk_ids)``), computed by the format's MoE op. The shared expert (id ``E``) is read from
    the block's quantized shared-expert linears, with their scales; the weight tensors the
    block passes are those same weights, without the scales."""

    def __init__(self, layout: nn.Module, kernels, fmt: str, shared: tuple | None,
                 block: tuple[int, int] | None = None):
        super().__init__()
        self.fmt, self.block = fmt, block
        self.gate_up_proj = QuantizedExpertWeight(layout.gate_up_proj, fmt, block)
        self.down_proj = QuantizedExpertWeight(layout.down_proj, fmt, block)
        object.__setattr__(self, "_shared", shared)  # (gate_up, down) quantized linears
        self._moe = kernels.fused_moe_w8a16 if fmt == "int8" else kernels.fused_moe_fp8_block

    def _scale_of(self, linear: nn.Module) -> torch.Tensor:
        return linear.weight_scale if self.fmt == "int8" else linear.weight_scale_inv

    def _run(self, x, topk_weights, topk_ids, shared) -> torch.Tensor:
        w13, w2 = self.gate_up_proj, self.down_proj
        args = [x, w13.weight, w13.scale, w2.weight, w2.scale, topk_weights, topk_ids,
                *shared]
        if self.fmt != "int8":
            args += list(self.block)
        return self._moe(*args)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_w13: torch.Tensor, shared_w2: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``[T, k + 1]`` (the last slot the shared expert's) -> each
        slot's weighted expert output ``[T, k + 1, H]``."""
        if self._shared is None:
            raise NotImplementedError("8-bit experts need the block's shared expert quantized "
                                      "in the same format")
        gate_up, down = self._shared
        shared = (gate_up.weight, self._scale_of(gate_up), down.weight, self._scale_of(down))
        return self._run(x, topk_weights, topk_ids, shared)

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
        """Routing ``[T, k]`` among the routed experts only -> ``[T, k, H]``; expert 0's
        weights fill the shared expert's arguments (no slot reads them)."""
        w13, w2 = self.gate_up_proj, self.down_proj
        shared = (w13.weight[0], w13.scale[0], w2.weight[0], w2.scale[0])
        return self._run(x, topk_weights, topk_ids, shared)
