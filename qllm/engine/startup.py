"""An engine's start-up, phase by phase: where the seconds went and whether the compile cache
(``qllm.runner.compile_cache``) was cold or warm."""

from __future__ import annotations

import contextlib
import time

from qllm.runner import compile_cache
from qllm.runner.autotune_log import AutotuneLog
from qllm.runner.compile_cache import CompileCache
from qllm.runner.triton_compiles import TritonCompileLog

# dynamo's timer of a whole frame's compile (tracing, AOT autograd, Inductor, cache loads),
# in torch 2.11 and 2.13 alike
FRAME_COMPILE_TIMER = "_compile.compile_inner"


def compile_seconds_so_far() -> float | None:
    """Seconds this process has spent in torch.compile, or None where torch does not say."""
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", None)
    if metrics is None:
        return None
    return sum(metrics.get(FRAME_COMPILE_TIMER, ()))


class StartupReport:
    """Times an engine's start-up phases (``phase``) from its construction to ``ready``.

    torch.compile runs lazily, inside whichever phase first calls a compiled region (on CUDA,
    the first decode graph's warm-up run), so each phase's seconds here leave out the compile
    time within it, which is reported as ``compile`` instead. The cache's lookups are counted
    from construction to each ``summary``: on CPU, where nothing is compiled until the first
    request, ask after it. Triton's own compiles (``TritonCompileLog``: the plugins' kernels
    and the libraries' they launch) are counted within ``with report.triton_compiles:``, and
    the tuning runs of autotuned kernels where ``autotunes`` is given to
    ``qllm.runner.parallel_autotune``."""

    def __init__(self, cache: CompileCache):
        self.cache = cache
        self.started = time.perf_counter()
        self.phase_seconds: dict[str, float] = {}
        self.ready_seconds: float | None = None
        self._compiled_before = compile_seconds_so_far()
        self._lookups_before = compile_cache.lookups()
        self._triton_entries_before = cache.triton_entries()
        self.triton_compiles = TritonCompileLog()
        self.autotunes = AutotuneLog()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name``, less the torch.compile time within it; Triton's
        compiles within it count under ``name`` (``TritonCompileLog.phase``)."""
        start, compiled = time.perf_counter(), compile_seconds_so_far()
        outer, self.triton_compiles.phase = self.triton_compiles.phase, name
        try:
            yield
        finally:
            self.triton_compiles.phase = outer
            seconds = time.perf_counter() - start
            if compiled is not None:
                seconds -= compile_seconds_so_far() - compiled
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def ready(self) -> str:
        """Mark the engine ready (the time not in any phase or compiling becomes phase
        ``other``); returns the start-up line to log."""
        self.ready_seconds = time.perf_counter() - self.started
        compiled = compile_seconds_so_far()
        compiling = 0.0 if compiled is None else compiled - self._compiled_before
        self.phase_seconds["other"] = (self.ready_seconds - compiling
                                       - sum(self.phase_seconds.values()))
        return self.line()

    def summary(self) -> dict:
        """Start-up seconds (to ``ready``) and per phase, the torch.compile seconds since
        construction (None where torch does not time them), and the compile cache: its
        folder, state, torch's lookups and the Triton cache entries added since
        construction, Triton's compiles counted (``TritonCompileLog.summary``) and the
        autotuned kernels' tuning runs (``AutotuneLog.summary``)."""
        compiled = compile_seconds_so_far()
        lookups = compile_cache.lookups_since(self._lookups_before)
        entries = self.cache.triton_entries()
        return {
            "seconds": None if self.ready_seconds is None else round(self.ready_seconds, 2),
            "phases": {name: round(seconds, 2) for name, seconds in self.phase_seconds.items()},
            "compile_seconds": None if compiled is None
            else round(compiled - self._compiled_before, 2),
            "compile_cache": {
                "dir": None if self.cache.folder is None else str(self.cache.folder),
                "state": compile_cache.cache_state(lookups) if self.cache.enabled else "off",
                "lookups": lookups,
                "new_triton_entries": None if entries is None
                else entries - self._triton_entries_before,
            },
            "triton_jit": self.triton_compiles.summary(),
            "autotune": self.autotunes.summary(),
        }

    def line(self) -> str:
        """One line: the seconds to ready, per phase and compiling, and the cache's state."""
        summary = self.summary()
        parts = [f"{name.replace('_', ' ')} {seconds:.1f} s"
                 for name, seconds in summary["phases"].items()]
        compiled = summary["compile_seconds"]
        parts.append("compile " + ("(untimed by this torch)" if compiled is None
                                   else f"{compiled:.1f} s"))
        if summary["triton_jit"]["compiled"] or summary["triton_jit"]["cached"]:
            parts.append(self.triton_compiles.line())
        if summary["autotune"]["keys"]:
            parts.append(self.autotunes.line())
        cache = summary["compile_cache"]
        lookups = "; ".join(f"{name.replace('_', ' ')} {counts['hits']} hits, "
                            f"{counts['misses']} misses"
                            + (f", {counts['bypasses']} bypasses" if counts["bypasses"] else "")
                            for name, counts in cache["lookups"].items())
        where = (f"compile cache {cache['state']} ({lookups}; "
                 f"{cache['new_triton_entries']} new Triton entries) in {cache['dir']}"
                 if self.cache.enabled else f"compile cache off ({lookups})")
        total = summary["seconds"]
        head = "engine ready" if total is None else f"engine ready in {total:.1f} s"
        return f"{head}: {', '.join(parts)}; {where}"
