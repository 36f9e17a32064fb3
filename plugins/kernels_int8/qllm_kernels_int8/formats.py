"""The ``int8``, ``int8-experts``, ``fp8`` and ``fp8-experts`` weight formats
(``qllm.model.quantization.WeightFormat``).

Which modules become 8-bit (``int8-experts``, ``fp8-experts``: the MoE blocks' only, every
other ``Linear`` stays full precision):

- every module of qllm's ``Linear`` family (``Linear``, ``PackedLinear`` and subclasses such
  as the GDN input projection), unless its class or instance sets ``quantizable = False``;
  the embedding and the LM head are not ``Linear``s and stay full precision;
- the routed experts of an MoE block in the ``fused_moe`` contract (a child ``experts`` with
  stacked ``gate_up_proj`` / ``down_proj`` weights next to a ``shared_expert`` with
  ``gate_up_proj`` / ``down_proj`` linears), together with its shared expert.

Loading an fp8 checkpoint (config.json ``quantization_config.quant_method == "fp8"``), the
checkpoint decides: a module becomes fp8 when every checkpoint tensor that loads into its
weight is fp8. So what the checkpoint keeps in bf16 (``modules_to_not_convert``: the router
and shared-expert gate, the GDN ``in_proj_a`` / ``in_proj_b``, ...) stays bf16, and a fused
module that mixes fp8 and bf16 projections (qllm's one GDN input matmul over Qwen's fp8
``in_proj_qkv`` / ``in_proj_z`` and bf16 ``in_proj_b`` / ``in_proj_a``) stays in the model
dtype, its fp8 parts dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from qllm.layers.linear import Linear
from qllm.model.loader import CheckpointError, resolve_name
from qllm.model.quantization import WeightFormat, swap_modules

from qllm_kernels_int8.layers import (Fp8Block, Fp8Linear, Int8Linear, QuantizedExperts,
                                      QuantizedExpertWeight, QuantizedLinear)
from qllm_kernels_int8.quant import FP8_DTYPE, dequantize_fp8_blocks

DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "<linear>.weight" -> "<linear>.weight_scale_inv"


def _is_experts(module: nn.Module) -> bool:
    """A routed-experts module in the ``fused_moe`` contract: stacked 3-D weights."""
    return all(hasattr(getattr(module, name, None), "shard_offsets")
               and getattr(getattr(module, name), "weight", torch.empty(0)).dim() == 3
               for name in ("gate_up_proj", "down_proj"))


def _quantizable(module: nn.Module) -> bool:
    return isinstance(module, Linear) and getattr(module, "quantizable", True)


class EightBitFormat(WeightFormat):
    """Shared by both formats: the module swap, driven by ``make_linear`` /
    ``make_experts``."""

    fmt = ""
    block: tuple[int, int] | None = None
    dense = True  # whether Linears outside the MoE blocks become 8-bit too

    def __init__(self, quant_config: dict | None):
        self.quant_config = quant_config

    def make_linear(self, layout: nn.Module, kernels) -> QuantizedLinear:
        raise NotImplementedError

    def replace_modules(self, model: nn.Module, kernels,
                        checkpoint: dict[str, torch.dtype] | None) -> None:
        convert = self._converter(model, checkpoint)
        moe_blocks = []

        def replace(name: str, module: nn.Module) -> nn.Module | None:
            if _is_experts(getattr(module, "experts", None)) and hasattr(module,
                                                                         "shared_expert"):
                moe_blocks.append(name)
                self._replace_moe(name, module, kernels, convert)
                return None
            if self.dense and _quantizable(module) and convert(name + ".weight"):
                return self.make_linear(module, kernels)
            return None

        swap_modules(model, replace)
        if not self.dense and not moe_blocks:
            raise ValueError(f"weight format {self.name!r} quantizes MoE experts only, and "
                             f"{type(model).__name__} has none; use {self.fmt!r} for its "
                             f"projections")

    def _replace_moe(self, name: str, block: nn.Module, kernels, convert) -> None:
        """The shared expert's linears, then the routed experts reading them; both stay
        full precision unless both convert."""
        shared = block.shared_expert
        parts = ("gate_up_proj", "down_proj")
        experts_name = f"{name}.experts"
        if not (all(convert(f"{experts_name}.{p}.weight") for p in parts)
                and all(_quantizable(getattr(shared, p))
                        and convert(f"{name}.shared_expert.{p}.weight") for p in parts)):
            for part in parts:  # the full-precision experts read the shared expert's weights
                getattr(shared, part).quantizable = False
            return
        for part in parts:
            setattr(shared, part, self.make_linear(getattr(shared, part), kernels))
        block.experts = QuantizedExperts(block.experts, kernels, self.fmt,
                                         tuple(getattr(shared, p) for p in parts), self.block)

    def _converter(self, model: nn.Module, checkpoint: dict[str, torch.dtype] | None):
        """``convert(parameter name) -> bool``: everything, unless this is a quantized
        checkpoint: then the parameters every checkpoint tensor of which is fp8."""
        if self.quant_config is None or checkpoint is None:
            return lambda name: True
        dtypes: dict[str, set] = {}
        for ckpt_name, dtype in checkpoint.items():
            if ckpt_name.endswith(SCALE_SUFFIX):
                continue
            resolved = resolve_name(model, ckpt_name)
            if resolved is not None:
                dtypes.setdefault(resolved[0], set()).add(dtype)
        return lambda name: dtypes.get(name, set()) == {FP8_DTYPE}

    def map_checkpoint(self, model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, object]]:
        """An fp8 checkpoint: each fp8 ``<linear>.weight`` with its ``weight_scale_inv`` as
        one ``Fp8Block`` for an 8-bit module, or dequantized to fp32 for a full-precision one
        (the loader rounds it to the model dtype). Other tensors pass unchanged."""
        if self.quant_config is None:
            yield from weights
            return
        block = tuple(self.quant_config.get("weight_block_size") or DEFAULT_BLOCK)
        modules = dict(model.named_modules())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if name.endswith(".weight" + SCALE_SUFFIX):
                base, kind = name[:-len(SCALE_SUFFIX)], "scale"
            elif name.endswith(".weight") and tensor.dtype == FP8_DTYPE:
                base, kind = name, "weight"
            else:
                yield name, tensor
                continue
            entry = pending.setdefault(base, {})
            entry[kind] = tensor
            if len(entry) < 2:
                continue
            del pending[base]
            paired = Fp8Block(entry["weight"], entry["scale"], block)
            resolved = resolve_name(model, base)
            owner = modules.get(resolved[0].rpartition(".")[0]) if resolved else None
            if isinstance(owner, (QuantizedLinear, QuantizedExpertWeight)):
                yield base, paired
            else:
                yield base, dequantize_fp8_blocks(paired.q, paired.scale_inv, block)
        if pending:
            names = sorted(pending)[:5]
            raise CheckpointError(f"fp8 weights without their weight_scale_inv (or scales "
                                  f"without weights) in the checkpoint: {names}")


class Int8Format(EightBitFormat):
    """INT8 weight-only (W8A16): per-output-channel scales, quantized at load from a
    full-precision checkpoint."""

    name = fmt = "int8"

    def make_linear(self, layout, kernels):
        return Int8Linear(layout, kernels)


class Int8ExpertsFormat(Int8Format):
    """INT8 weight-only on the MoE blocks alone (routed and shared experts); attention, GDN
    and dense-MLP projections stay full precision. The experts are most of an MoE model's
    bytes (about 92% of Qwen3.5-35B-A3B's), and at many rows per step the dense projections
    are compute bound, where a W8A16 GEMM's conversion costs more than the bytes it saves;
    so for throughput this keeps nearly all of ``int8``'s memory saving and none of its
    dense-GEMM cost."""

    name = "int8-experts"
    dense = False


class Fp8Format(EightBitFormat):
    """FP8 e4m3 with block scales (128 x 128 unless the checkpoint says otherwise): Qwen's
    FP8 checkpoints, or quantized at load from a full-precision one."""

    name = fmt = "fp8"

    def __init__(self, quant_config: dict | None):
        super().__init__(quant_config)
        if quant_config is not None:
            unsupported = {key: quant_config.get(key) for key, ok in (
                ("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None)))
                if quant_config.get(key) not in ok}
            if unsupported:
                raise NotImplementedError(f"fp8 checkpoint with {unsupported}: only e4m3 "
                                          f"weights and dynamic activation scales load")
        block = (quant_config or {}).get("weight_block_size") or DEFAULT_BLOCK
        if len(block) != 2:
            raise NotImplementedError(f"fp8 weight_block_size {block}: only 2-D blocks load")
        self.block = tuple(int(b) for b in block)

    def make_linear(self, layout, kernels):
        return Fp8Linear(layout, kernels, self.block)


class Fp8ExpertsFormat(Fp8Format):
    """FP8 e4m3 (128 x 128 block scales, quantized at load) on the MoE blocks alone, as
    ``int8-experts`` does for int8: the routed and shared experts in fp8 (their W8A8 GEMMs),
    every other projection full precision."""

    name = "fp8-experts"
    dense = False
