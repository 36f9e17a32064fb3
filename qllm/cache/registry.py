"""The cache registry: sizes one pool per cache kind from the model's layers, and admits,
grows and frees sequences across all of them at once."""

from __future__ import annotations

import contextlib
import logging

import torch

from qllm.batch import Sequence
from qllm.cache.base import CachePool, CacheTooSmallError
from qllm.config import EngineConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_BYTES = 2 << 30
CUDA_ACTIVATION_HEADROOM_BYTES = 2 << 30


__all__ = ["CacheRegistry", "CacheTooSmallError"]


class CacheRegistry:
    """Every cache pool of one engine; the scheduler talks to this, never to a pool directly."""

    def __init__(self, model: torch.nn.Module, layer_kinds: dict, cache_kinds: dict,
                 config: EngineConfig, device: torch.device, agree=None):
        """``layer_kinds`` and ``cache_kinds`` are the registered ones (``PluginRegistry``'s,
        ``LayerKindSpec`` and ``CacheKindSpec`` by name).

        ``agree(units) -> units``: tensor-parallel ranks settle on one unit count per kind
        (the fewest any rank has room for), so that block tables and slots mean the same
        everywhere; each rank's units hold its own heads."""
        by_kind: dict[str, list] = {}
        for layer in model.cache_layers():
            kind = layer_kinds.get(layer.layer_kind)
            if kind is None:
                raise ValueError(f"layer kind {layer.layer_kind!r} of {type(layer).__name__} is "
                                 f"not registered; known: {sorted(layer_kinds)}")
            by_kind.setdefault(kind.cache_kind, []).append(layer)

        specs = {}
        for name in by_kind:
            if name not in cache_kinds:
                raise ValueError(f"cache kind {name!r} is not registered; "
                                 f"known: {sorted(cache_kinds)}")
            specs[name] = cache_kinds[name]

        fixed = {name: spec.fixed_units(config) for name, spec in specs.items()}
        fixed_bytes = sum(specs[n].bytes_per_unit(by_kind[n], config) * units
                          for n, units in fixed.items() if units is not None)
        fixed_bytes += sum(spec.reserved_bytes(by_kind[n], config) for n, spec in specs.items())
        sized = [n for n, units in fixed.items() if units is None]
        budget = self._budget(config, device) - fixed_bytes
        if budget <= 0 and sized:
            raise CacheTooSmallError(f"no memory left for {sized} after "
                                     f"{fixed_bytes / 2**30:.2f} GiB of fixed-size caches")
        # the CPU's default budget is a ceiling, not a size: a small model takes what it uses
        cpu_default = device.type != "cuda" and config.kv_cache_memory_bytes is None
        for name in sized:  # split what is left evenly between budget-sized kinds
            per_unit = specs[name].bytes_per_unit(by_kind[name], config)
            units = config.num_kv_blocks or budget // len(sized) // per_unit
            in_use = specs[name].units_in_use_at_most(config)
            if cpu_default and not config.num_kv_blocks and in_use is not None:
                units = min(units, in_use)
            fixed[name] = int(units)
        if agree is not None:
            fixed = agree(fixed)

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
        self._prefix_capable = not inexact
        self.prefix_caching = config.enable_prefix_caching and not inexact
        if config.enable_prefix_caching and inexact:
            logger.info("prefix caching is off: it cannot be exact for cache kinds %s "
                        "(for recurrent state, give it prefix_state_cache_slots)", inexact)
        for pool in self.pools.values():
            pool.set_prefix_caching(self.prefix_caching)
            pool.on_forget_prefix = self._forget_prefix
            pool.check_capacity(config.max_model_len)
        # admissions with prefix caching on, their tokens, the tokens served from the cache,
        # and those the KV cache held but that were recomputed (no state checkpoint reached)
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_recomputed_tokens = 0

    @staticmethod
    def _budget(config: EngineConfig, device: torch.device) -> int:
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if device.type == "cuda":
            # blocks the allocator caches but no tensor holds (loading's temporaries, an
            # engine deleted before this one) would otherwise count as used
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            reserve = total * (1 - config.gpu_memory_utilization) + CUDA_ACTIVATION_HEADROOM_BYTES
            return int(free - reserve)
        return CPU_DEFAULT_CACHE_BYTES

    def admit(self, seq: Sequence) -> int | None:
        """Give a waiting sequence what every pool needs up front, all or nothing: None when
        some pool has no room, or when the sequence waits for a prefix another one is about
        to make servable (``CachePool.awaits_prefix``); else how many of its first tokens the
        prefix cache serves (the scheduler starts the sequence there)."""
        for pool in self.pools.values():
            if not pool.admit(seq):
                self.release(seq)  # pools release what a sequence never took as a no-op
                return None
        if not self.prefix_caching:
            return 0
        found, prefix = self._cached_prefix(seq)
        if prefix < found and any(pool.awaits_prefix(seq, prefix, found)
                                  for pool in self.pools.values()):
            self.release(seq)
            return None
        for pool in self.pools.values():
            pool.take_prefix(seq, prefix, found)
        self.prefix_queries += 1
        self.prefix_query_tokens += len(seq)
        self.prefix_hit_tokens += prefix
        self.prefix_recomputed_tokens += found - prefix
        return prefix

    def set_prefix_caching(self, enabled: bool) -> bool:
        """Turn prefix caching off, or back on where the engine has it; returns whether it
        was on (the engine's warm-up turns it off while it runs)."""
        was, self.prefix_caching = self.prefix_caching, enabled and self._prefix_capable
        for pool in self.pools.values():
            pool.set_prefix_caching(self.prefix_caching)
        return was

    @contextlib.contextmanager
    def prefix_caching_paused(self):
        """Within: the prefix cache is emptied and prefix caching is off (no hit or
        state-checkpoint boundary shapes a step). After: it is back on where it was, and
        emptied again, so no prefix computed within outlives it."""
        self.reset_prefix_cache()
        enabled = self.set_prefix_caching(False)
        try:
            yield
        finally:
            self.set_prefix_caching(enabled)
            self.reset_prefix_cache()

    def _cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        """``(found, prefix)``: the longest cached prefix of ``seq`` some pool took at
        admission (the ``paged_kv`` hit), and the longest every pool can serve (cut back to
        a recurrent-state checkpoint for hybrid models)."""
        found = max(pool.cached_prefix_len(seq) for pool in self.pools.values())
        prefix = found
        while True:
            shortest = min(pool.longest_prefix(seq, prefix) for pool in self.pools.values())
            if shortest == prefix:
                return found, prefix
            prefix = shortest

    def needs_eager(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a prefill step computing ``seq``'s next ``num_tokens`` tokens must run
        eagerly (``CachePool.needs_eager``)."""
        return any(pool.needs_eager(seq, num_tokens) for pool in self.pools.values())

    def _forget_prefix(self, block_hash: int) -> None:
        for pool in self.pools.values():
            pool.forget_prefix(block_hash)

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters since start-up (``/metrics``): queries, query tokens, hit
        tokens, tokens KV-cached but recomputed for lack of a state checkpoint, and each
        pool's own (``prefix_stats``)."""
        stats = {"queries": self.prefix_queries, "query_tokens": self.prefix_query_tokens,
                 "hit_tokens": self.prefix_hit_tokens,
                 "recomputed_tokens": self.prefix_recomputed_tokens}
        for pool in self.pools.values():
            stats.update(getattr(pool, "prefix_stats", dict)())
        return stats

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
        """Free all of ``seq``'s cache (the scheduler then counts none of its tokens as
        computed)."""
        for pool in self.pools.values():
            pool.release(seq)

    def usage(self) -> dict[str, float]:
        return {name: pool.usage() for name, pool in self.pools.items()}

    def all_free(self) -> bool:
        """True when no sequence holds any unit of any pool (for leak checks)."""
        return all(pool.num_free_units == pool.num_units for pool in self.pools.values())
