"""Weight formats (quantization) as plugins: the contract, the choice of a format, and helpers
for formats that swap modules.

A plugin registers ``WeightFormatSpec``s through the ``qllm_weight_formats`` hook; the core
knows no format by name. ``resolve_weight_format`` picks the one for an engine: the
checkpoint's own ``quantization_config`` (config.json) when it has one, else
``EngineConfig.quantization``. The chosen spec's ``create`` returns a ``WeightFormat``, which
``qllm.model.builder.build_model`` drives in four steps:

1. ``replace_modules(model, kernels, checkpoint)`` on the meta-device model, after it is cast
   to the engine dtype and before it is materialised (gpt-fast style module swap): the
   format replaces the modules whose weights it stores, e.g. a ``Linear`` by one holding int8
   weights and a scale per row; ``checkpoint`` gives each checkpoint tensor's dtype (from
   the safetensors headers; ``None`` for dummy weights), so a format can leave full
   precision the modules a quantized checkpoint keeps in full precision.
2. the core materialises the model and calls ``reset_derived_buffers`` (a swapped module
   may zero its storage there).
3. ``map_checkpoint(model, weights)`` wraps the checkpoint's ``(name, tensor)`` stream before
   the loader maps names onto parameters: e.g. pair each fp8 weight with its scale tensor.
   The loader then hands each tensor to its module's ``weight_loader`` as usual.
4. ``process_weights_after_loading(model)`` (by default: each module's own method of that
   name, for modules that define one).

Swapped modules call the kernel ops that their spec lists in ``WeightFormatSpec.ops``;
implementations register through ``qllm_kernels`` like every op (a plain-torch reference at
priority 0, faster ones above), so ``kernels={...}`` pins work for them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


class UnknownWeightFormatError(ValueError):
    """No installed plugin provides the requested or the checkpoint's weight format."""


class WeightFormat:
    """One model's weight format, made by ``WeightFormatSpec.create``; see the module
    docstring for when the core calls each method."""

    name = ""

    def replace_modules(self, model: nn.Module, kernels,
                        checkpoint: dict[str, torch.dtype] | None) -> None:
        """Swap modules of ``model`` (on the meta device) for the format's own."""
        raise NotImplementedError

    def map_checkpoint(self, model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, object]]:
        """Wrap the checkpoint's ``(name, tensor)`` stream; by default unchanged."""
        return weights

    def process_weights_after_loading(self, model: nn.Module) -> None:
        """After every tensor is loaded; by default each module's own
        ``process_weights_after_loading()``."""
        for module in model.modules():
            if module is not model and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()


def checkpoint_quantization_config(hf_config) -> dict | None:
    """The ``quantization_config`` of a checkpoint's config (top level, or in the text config
    of a multimodal one) as a dict, or ``None``."""
    for config in (hf_config, hf_config.get_text_config()):
        found = getattr(config, "quantization_config", None)
        if found is not None:
            return found.to_dict() if hasattr(found, "to_dict") else dict(found)
    return None


def _known(formats) -> str:
    listing = [f"{name!r} ({spec.plugin}{': ' + spec.description if spec.description else ''})"
               for name, spec in sorted(formats.items())]
    return "; ".join(listing) or "none (no installed plugin provides a weight format)"


def resolve_weight_format(plugins, requested: str | None, hf_config, engine_config,
                          kernels=None) -> WeightFormat | None:
    """The weight format for an engine, or ``None`` for plain full-precision weights.

    A checkpoint whose config.json has a ``quantization_config`` is loaded by the format
    whose ``checkpoint_methods`` include its ``quant_method`` (``requested`` may name that
    format or be ``None``); otherwise ``requested`` names the format that quantizes the
    full-precision checkpoint at load. Unknown names raise ``UnknownWeightFormatError``
    listing the known ones. With ``kernels``, every op the format's modules call must have
    an implementation among them."""
    formats = plugins.weight_formats
    quant_config = checkpoint_quantization_config(hf_config)
    if quant_config is not None:
        method = quant_config.get("quant_method")
        serving = [spec for spec in formats.values() if method in spec.checkpoint_methods]
        if not serving:
            raise UnknownWeightFormatError(
                f"the checkpoint is stored quantized (config.json quantization_config "
                f"quant_method={method!r}) and no installed plugin loads that format. "
                f"Known weight formats: {_known(formats)}")
        spec = serving[0]
        if requested is not None and requested != spec.name:
            raise ValueError(
                f"quantization={requested!r} was asked for, but the checkpoint is already "
                f"stored quantized (quant_method={method!r}, loaded by weight format "
                f"{spec.name!r}); leave quantization unset or pass {spec.name!r}")
    elif requested is None:
        return None
    else:
        spec = formats.get(requested)
        if spec is None:
            raise UnknownWeightFormatError(
                f"unknown quantization {requested!r}. Known weight formats: {_known(formats)}")
        quant_config = None
    if kernels is not None:
        missing = [op for op in spec.ops if op not in kernels.chosen]
        if missing:
            raise ValueError(f"weight format {spec.name!r} needs kernel ops {missing}, which "
                             f"no installed plugin serves here")
    return spec.create(quant_config, engine_config)


def swap_modules(model: nn.Module,
                 replace: Callable[[str, nn.Module], nn.Module | None]) -> list[str]:
    """Walk ``model``'s submodules; where ``replace(qualified name, module)`` returns a module,
    put it in the old one's place (without visiting the old one's children). Returns the
    names swapped."""
    swapped = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}{child_name}"
            new = replace(name, child)
            if new is None:
                visit(name + ".", child)
            else:
                setattr(parent, child_name, new)
                swapped.append(name)

    visit("", model)
    return swapped


def row_runs(layout: nn.Module, shard: str | None, rows: int,
             total_rows: int) -> list[tuple[int, int, int]]:
    """Where a checkpoint tensor of ``rows`` rows lands in a (packed) linear's ``weight``:
    ``[(source row, destination row, length)]`` runs. ``layout`` is the full-precision module
    (``qllm.layers.linear.Linear`` or a subclass): a whole tensor for ``shard`` ``None``, the
    ``(offset, size)`` of ``shard_offsets[shard]``, or, for loaders that move rows
    otherwise (Qwen3-Next's rows grouped per key head), what ``layout.weight_loader`` does
    to a probe of row numbers."""
    if shard is None:
        return [(0, 0, rows)]
    offsets = layout.shard_offsets.get(shard)
    if isinstance(offsets, tuple) and len(offsets) == 2:
        return [(0, offsets[0], rows)]
    probe = torch.full((total_rows, layout.in_features), -1, dtype=torch.int32)
    source = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, layout.in_features)
    layout.weight_loader(probe, source, shard)
    sources = probe[:, 0].tolist()
    runs: list[list[int]] = []
    for dest, src in enumerate(sources):
        if src < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dest:
            runs[-1][2] += 1
        else:
            runs.append([src, dest, 1])
    return [tuple(run) for run in runs]
