"""The cache registry: sizes one pool per cache kind from the model's layers, and admits,
grows and frees sequences across all of them at once."""

from __future__ import annotations

import logging

import torch

from qllm.cache.base import CachePool, CacheTooSmallError
from qllm.config import EngineConfig
from qllm.engine.sequence import Sequence
from qllm.plugins import PluginRegistry

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_BYTES = 2 << 30
CUDA_ACTIVATION_HEADROOM_BYTES = 2 << 30


__all__ = ["CacheRegistry", "CacheTooSmallError"]


class CacheRegistry:
    """Every cache pool of one engine; the scheduler talks to this, never to a pool directly."""

    def __init__(self, model: torch.nn.Module, plugins: PluginRegistry, config: EngineConfig,
                 device: torch.device):
        by_kind: dict[str, list] = {}
        for layer in model.cache_layers():
            kind = plugins.layer_kinds.get(layer.layer_kind)
            if kind is None:
                raise ValueError(f"layer kind {layer.layer_kind!r} of {type(layer).__name__} is "
                                 f"not registered; known: {sorted(plugins.layer_kinds)}")
            by_kind.setdefault(kind.cache_kind, []).append(layer)

        specs = {}
        for name in by_kind:
            if name not in plugins.cache_kinds:
                raise ValueError(f"cache kind {name!r} is not registered; "
                                 f"known: {sorted(plugins.cache_kinds)}")
            specs[name] = plugins.cache_kinds[name]

        fixed = {name: spec.fixed_units(config) for name, spec in specs.items()}
        fixed_bytes = sum(specs[n].bytes_per_unit(by_kind[n], config) * units
                          for n, units in fixed.items() if units is not None)
        sized = [n for n, units in fixed.items() if units is None]
        budget = self._budget(config, device) - fixed_bytes
        if budget <= 0 and sized:
            raise CacheTooSmallError(f"no memory left for {sized} after "
                                     f"{fixed_bytes / 2**30:.2f} GiB of fixed-size caches")
        for name in sized:  # split what is left evenly between budget-sized kinds
            per_unit = specs[name].bytes_per_unit(by_kind[name], config)
            units = config.num_kv_blocks or budget // len(sized) // per_unit
            fixed[name] = int(units)

        self.pools: dict[str, CachePool] = {}
        for name, spec in specs.items():
            pool = spec.factory(by_kind[name], fixed[name], config, device)
            if not isinstance(pool, CachePool) or pool.name != name:
                raise TypeError(f"cache kind {name!r}: its factory returned "
                                f"{type(pool).__name__}, not a CachePool named {name!r}")
            self.pools[name] = pool
            logger.info("cache %s: %d units for %d layers", name, fixed[name],
                        len(by_kind[name]))

        inexact = [name for name, pool in self.pools.items() if not pool.supports_prefix_caching]
        self.prefix_caching = config.enable_prefix_caching and not inexact
        if config.enable_prefix_caching and inexact:
            logger.info("prefix caching is off: it cannot be exact for cache kinds %s "
                        "(e.g. recurrent state)", inexact)
        for pool in self.pools.values():
            pool.set_prefix_caching(self.prefix_caching)
            pool.check_capacity(config.max_model_len)

    @staticmethod
    def _budget(config: EngineConfig, device: torch.device) -> int:
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            reserve = total * (1 - config.gpu_memory_utilization) + CUDA_ACTIVATION_HEADROOM_BYTES
            return int(free - reserve)
        return CPU_DEFAULT_CACHE_BYTES

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence what every pool needs up front; all or nothing."""
        for pool in self.pools.values():
            if not pool.admit(seq):
                self.release(seq)  # pools release what a sequence never took as a no-op
                return False
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for ``num_new_tokens`` more tokens in every pool. On False, what was reserved
        stays with ``seq`` and is freed with it."""
        return all(pool.reserve(seq, num_new_tokens) for pool in self.pools.values())

    def register_computed(self, seq: Sequence) -> None:
        for pool in self.pools.values():
            pool.register_computed(seq)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes that no sequence holds, in every pool."""
        for pool in self.pools.values():
            pool.reset_prefix_cache()

    def release(self, seq: Sequence) -> None:
        """Free all of ``seq``'s cache; none of its tokens count as computed any more."""
        for pool in self.pools.values():
            pool.release(seq)
        seq.num_computed_tokens = 0

    def usage(self) -> dict[str, float]:
        return {name: pool.usage() for name, pool in self.pools.items()}

    def all_free(self) -> bool:
        """True when no sequence holds any unit of any pool (for leak checks)."""
        return all(pool.num_free_units == pool.num_units for pool in self.pools.values())
