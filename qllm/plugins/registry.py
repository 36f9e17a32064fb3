"""The plugin manager: loads ``qllm`` entry points and collects what they register."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Iterable

import pluggy
import torch

from qllm.ops.contracts import parameter_mismatch
from qllm.plugins import builtins, hookspecs
from qllm.plugins.specs import CacheKindSpec, KernelSpec, LayerKindSpec, ModelSpec, WeightFormatSpec

logger = logging.getLogger(__name__)


class DuplicateRegistrationError(ValueError):
    """Two plugins registered the same name for a model, cache kind, layer kind or kernel."""


class UnknownArchitectureError(ValueError):
    """No installed plugin serves a checkpoint's architecture."""


class KernelContractError(TypeError):
    """A kernel does not take its op's parameters (``qllm.ops.contracts``), or its op has no
    reference to check it against."""


@dataclass(frozen=True)
class Kernels:
    """The kernels chosen for one model: ``kernels.<op>(...)`` calls the winner for that op."""

    chosen: dict[str, KernelSpec]

    def __getattr__(self, op: str):
        try:
            return self.chosen[op].fn
        except KeyError:
            raise AttributeError(f"no kernel registered for op {op!r}") from None

    def names(self) -> dict[str, str]:
        """Which implementation serves each op, for logs."""
        return {op: spec.name for op, spec in sorted(self.chosen.items())}


def _unique(items: Iterable, key, what: str) -> dict:
    found: dict = {}
    for item in items:
        name = key(item)
        if name in found:
            raise DuplicateRegistrationError(f"{what} {name!r} is registered twice "
                                             f"({found[name]!r} and {item!r})")
        found[name] = item
    return found


class PluginRegistry:
    """Everything registered by the built-ins and the installed plugins."""

    def __init__(self, extra_plugins: Iterable[object] = (), load_entry_points: bool = True):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.manager.register(builtins, name="qllm.plugins.builtins")
        if load_entry_points:
            self.manager.load_setuptools_entrypoints(hookspecs.PROJECT_NAME)
        for plugin in extra_plugins:
            self.manager.register(plugin)

    def _collect(self, hook) -> list:
        return [spec for specs in hook() for spec in specs]

    def _collect_with_plugin(self, hook) -> list[tuple[str, object]]:
        """``(plugin, spec)`` for each spec ``hook`` returns, in the order ``hook()`` returns
        them; ``plugin`` is the registering distribution's name (``qllm-kernels-moe``), or the
        module's or class's for a plugin registered directly."""
        distributions = {id(plugin): dist.project_name
                         for plugin, dist in self.manager.list_plugin_distinfo()}
        return [(distributions.get(id(impl.plugin)) or getattr(impl.plugin, "__name__", None)
                 or type(impl.plugin).__name__, spec)
                for impl in reversed(hook.get_hookimpls()) for spec in impl.function()]

    @functools.cached_property
    def models(self) -> dict[str, ModelSpec]:
        return _unique(self._collect(self.manager.hook.qllm_models),
                       lambda spec: spec.architecture, "architecture")

    @functools.cached_property
    def cache_kinds(self) -> dict[str, CacheKindSpec]:
        return _unique(self._collect(self.manager.hook.qllm_cache_kinds),
                       lambda spec: spec.name, "cache kind")

    @functools.cached_property
    def layer_kinds(self) -> dict[str, LayerKindSpec]:
        return _unique(self._collect(self.manager.hook.qllm_layer_kinds),
                       lambda spec: spec.name, "layer kind")

    @functools.cached_property
    def weight_formats(self) -> dict[str, WeightFormatSpec]:
        return _unique(self._collect(self.manager.hook.qllm_weight_formats),
                       lambda spec: spec.name, "weight format")

    def model_spec(self, architectures: list[str]) -> ModelSpec:
        """The spec serving the first of ``architectures`` that some plugin serves."""
        for arch in architectures:
            if arch in self.models:
                return self.models[arch]
        served: dict[str, list[str]] = {}
        for spec in self.models.values():
            served.setdefault(spec.plugin, []).append(spec.architecture)
        listing = "; ".join(f"{plugin}: {', '.join(sorted(archs))}"
                            for plugin, archs in sorted(served.items())) or "none"
        raise UnknownArchitectureError(
            f"no installed qllm plugin serves architectures {architectures}. "
            f"Installed plugins and what they serve: {listing}. "
            f"Install the plugin for this model from the qllm source tree (e.g. "
            f"`pip install -e plugins/qwen3`).")

    def kernels(self, device: torch.device, dtype: torch.dtype,
                pinned: dict[str, str] | None = None) -> Kernels:
        """Choose, per op, the highest-priority kernel available on ``device`` for ``dtype``,
        or the implementation that ``pinned`` names for that op (e.g. ``{"fused_moe":
        "torch"}``); a pin naming an unknown op, an unknown implementation or one unavailable
        here raises ``ValueError``. Every registered kernel, available here or not, must take
        its op's reference parameters (``KernelContractError`` otherwise)."""
        by_op: dict[str, list[KernelSpec]] = {}
        plugin_of: dict[int, str] = {}
        for plugin, spec in self._collect_with_plugin(self.manager.hook.qllm_kernels):
            by_op.setdefault(spec.op, []).append(spec)
            plugin_of[id(spec)] = plugin
        pinned = dict(pinned or {})
        unknown_ops = sorted(set(pinned) - set(by_op))
        if unknown_ops:
            raise ValueError(f"kernels: no op named {unknown_ops}; ops: {sorted(by_op)}")
        chosen = {}
        for op, specs in by_op.items():
            named = _unique(specs, lambda spec: spec.name, f"kernel for op {op!r}")
            _check_contract(op, named, plugin_of)
            available = [s for s in specs if s.is_available(device, dtype)]
            if op in pinned:
                spec = named.get(pinned[op])
                if spec is None or spec not in available:
                    why = "is not registered" if spec is None else \
                        f"is not available on {device.type} for {dtype}"
                    raise ValueError(
                        f"kernels: {op}={pinned[op]!r} {why}; available here: "
                        f"{sorted(s.name for s in available)}")
                chosen[op] = spec
            elif available:
                chosen[op] = max(available, key=lambda s: s.priority)
        kernels = Kernels(chosen)
        logger.debug("kernels on %s for %s: %s", device.type, dtype, kernels.names())
        return kernels


def _check_contract(op: str, named: dict[str, KernelSpec], plugin_of: dict[int, str]) -> None:
    """Every kernel of ``op`` (``named``: by implementation name) takes the parameters of the
    op's reference, its ``torch`` kernel: a core op's from ``qllm.ops.contracts``, a plugin's
    own op's from that plugin."""
    reference = named.get("torch")
    if reference is None:
        plugins = sorted({plugin_of[id(spec)] for spec in named.values()})
        raise KernelContractError(
            f"op {op!r} (kernels {sorted(named)} from {plugins}) has no reference: it is not "
            f"a core op (qllm.ops.contracts) and no plugin registers its 'torch' kernel")
    for spec in named.values():
        mismatch = parameter_mismatch(spec.fn, reference.fn)
        if mismatch:
            raise KernelContractError(
                f"kernel {spec.name!r} of op {op!r} from plugin {plugin_of[id(spec)]} does not "
                f"take the op's parameters: it {mismatch}")


@functools.lru_cache(maxsize=1)
def default_registry() -> PluginRegistry:
    """The registry of the built-ins plus every installed plugin, loaded once per process."""
    return PluginRegistry()
