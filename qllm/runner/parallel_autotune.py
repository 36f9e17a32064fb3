"""Compile every candidate config of a ``triton.autotune``d kernel at once, in threads, before
Triton benchmarks them one by one.

Triton's autotuner compiles each config as it first benchmarks it, so a cold start compiles a
kernel's N configs in a row (fla's chunked gated delta rule kernels have 4 to 24 each). Triton's
compiler spends its time outside the GIL, so compiling them from a thread pool takes about one
config's time per core (Triton's own ``AsyncCompileMode`` does the submitting: a launch waits for
its kernel). ``parallel_autotune`` wraps ``Autotuner.run`` for its duration: on a tuning key the
autotuner has not seen, ``Autotuner.warmup`` (compile, no launch) of every pruned config runs
under that mode first. A config that fails to compile is left for the benchmark, which times it
as infinitely slow as it always did. With Triton's disk cache warm, the compiles are cache loads.
Given an ``AutotuneLog``, the wrapper also records each tuning run there (its kernel and
seconds), with the parallel compiles on or off.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

from qllm.runner.autotune_log import AutotuneLog
from qllm.switches import env_switch

SWITCH_ENV = "QLLM_PARALLEL_AUTOTUNE"  # "0" turns it off (to measure against); qllm.switches


def tuning_key(autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key ``autotuner.run(*args, **kwargs)`` tunes under, as Triton builds it: the
    argument values named in ``autotuner.keys``, then the dtypes of the tensor arguments."""
    named = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in autotuner.arg_names}
    key = [named[name] for name in autotuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


def untuned(autotuner, args: tuple, kwargs: dict) -> bool:
    """Whether ``autotuner.run(*args, **kwargs)`` will benchmark: it has several configs and
    has not tuned this key (``tuning_key``)."""
    return len(autotuner.configs) > 1 and tuning_key(autotuner, args, kwargs) not in autotuner.cache


@contextlib.contextmanager
def parallel_autotune(workers: int | None = None, enabled: bool = True,
                      log: AutotuneLog | None = None):
    """Within the block, an autotuned Triton kernel's first run with a new tuning key compiles
    all its configs in ``workers`` threads (default: the CPU count) before benchmarking them,
    and, with ``log``, is recorded there. The compiles stay one by one unless ``enabled``, with
    ``QLLM_PARALLEL_AUTOTUNE=0``, where Triton lacks ``AsyncCompileMode`` (before 3.4), or
    where an async compile is already active."""
    compile_ahead = enabled and env_switch(SWITCH_ENV)
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        compile_ahead, log = False, None
    try:
        from triton.runtime import _async_compile
    except ImportError:
        compile_ahead = False
    if not compile_ahead and log is None:
        yield
        return
    original_run = Autotuner.run
    pool = (ThreadPoolExecutor(workers or os.cpu_count() or 1,
                               thread_name_prefix="qllm-autotune") if compile_ahead else None)

    def run(self, *args, **kwargs):
        if not untuned(self, args, kwargs):
            return original_run(self, *args, **kwargs)
        start = time.perf_counter()
        if compile_ahead and _async_compile.active_mode.get() is None:
            compile_only = {name: value for name, value in kwargs.items() if name != "warmup"}
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True):
                self.warmup(*args, **compile_only)
        try:
            return original_run(self, *args, **kwargs)
        finally:
            if log is not None:
                log.record(self.base_fn.__name__, time.perf_counter() - start)

    Autotuner.run = run
    try:
        yield
    finally:
        Autotuner.run = original_run
        if pool is not None:
            pool.shutdown(wait=True)


def live_autotuners(kind: type | None = None) -> list:
    """Every Triton autotuner alive in this process, or every one of class ``kind`` (a
    subclass of Triton's ``Autotuner``, e.g. fla's)."""
    import gc

    from triton.runtime.autotuner import Autotuner

    kind = kind or Autotuner  # type(), not isinstance(): the latter asks a weak proxy for its
    # referent's class, which raises once the referent is gone
    return [obj for obj in gc.get_objects() if issubclass(type(obj), kind)]


def tuned_configs(autotuners=None) -> dict[str, list[dict]]:
    """The configs Triton autotuners picked (``autotuners``; default: every one alive in this
    process): per kernel name, one entry per tuning key, ``{key, kwargs, num_warps,
    num_stages, num_ctas, maxnreg}`` (keys as Triton builds them: the values of the
    autotuner's ``key`` arguments, then the tensor arguments' dtypes). What a table of pinned
    configs needs, read after a start-up on the GPU it is for."""
    found: dict[str, list[dict]] = {}
    for autotuner in live_autotuners() if autotuners is None else autotuners:
        for key, config in autotuner.cache.items():
            found.setdefault(autotuner.base_fn.__name__, []).append({
                "key": [value if isinstance(value, (int, float, str, bool)) else str(value)
                        for value in key],
                "kwargs": dict(config.kwargs), "num_warps": config.num_warps,
                "num_stages": config.num_stages, "num_ctas": config.num_ctas,
                "maxnreg": getattr(config, "maxnreg", None)})
    return {name: sorted(entries, key=lambda entry: str(entry["key"]))
            for name, entries in sorted(found.items())}
