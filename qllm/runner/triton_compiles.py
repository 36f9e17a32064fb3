"""Triton's just-in-time compiles in this process, per kernel: how many were compiled, how many
came from the on-disk cache, and the seconds compiling took.

Triton compiles a kernel at its first launch with each new specialization (constants, tile
config, argument alignment), in the launching thread; on a machine whose cache is cold this is
most of an engine's start-up. ``TritonCompileLog`` listens through
``triton.knobs.compilation.listener`` (Triton 3.4 and later; elsewhere it stays empty), in the
calling process only: Inductor's generated kernels compile in its worker processes and are
timed as torch.compile's own."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class KernelCompiles:
    """One kernel's compiles: ``compiled`` (cache misses), ``cached`` (loaded from the on-disk
    cache) and ``seconds`` (Triton's time in both)."""

    compiled: int = 0
    cached: int = 0
    seconds: float = 0.0


class TritonCompileLog:
    """Counts Triton's compiles by kernel name between ``start`` and ``stop`` (or within a
    ``with`` block), and by ``phase``: the label set while they happen (start-up phases; any
    compile outside one counts under ``other``). A listener installed before is kept and still
    called."""

    def __init__(self):
        self.kernels: dict[str, KernelCompiles] = {}
        self.phase: str | None = None
        self.phases: dict[str, KernelCompiles] = {}
        self._previous = None
        self._knobs = None
        self._lock = threading.Lock()  # compiles may run in worker threads

    def start(self) -> TritonCompileLog:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without knobs: nothing to count
            return self
        if not hasattr(knobs.compilation, "listener"):
            return self
        self._knobs = knobs
        self._previous = knobs.compilation.listener
        knobs.compilation.listener = self._on_compile
        return self

    def stop(self) -> None:
        if self._knobs is not None and self._knobs.compilation.listener == self._on_compile:
            self._knobs.compilation.listener = self._previous
        self._knobs = None

    def __enter__(self) -> TritonCompileLog:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _on_compile(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        name = getattr(src, "name", None) or metadata.get("name", "?")
        self.record(name, times.total / 1e6, cache_hit)
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group,
                           times=times, cache_hit=cache_hit)

    def record(self, name: str, seconds: float, cache_hit: bool) -> None:
        """Count one compile of kernel ``name`` (what the listener does per event)."""
        with self._lock:
            for entry in (self.kernels.setdefault(name, KernelCompiles()),
                          self.phases.setdefault(self.phase or "other", KernelCompiles())):
                entry.cached += cache_hit
                entry.compiled += not cache_hit
                entry.seconds += seconds

    def summary(self, top: int = 10) -> dict:
        """Totals (``compiled``, ``cached``, ``seconds``), the ``top`` kernels by seconds, each
        ``{name, compiled, cached, seconds}``, and ``by_phase``: ``{phase: {compiled, cached,
        seconds}}`` (seconds summed over threads: parallel compiles can exceed the wall
        time)."""
        with self._lock:
            kernels = sorted(self.kernels.items(), key=lambda item: -item[1].seconds)
            return {
                "compiled": sum(k.compiled for _, k in kernels),
                "cached": sum(k.cached for _, k in kernels),
                "seconds": round(sum(k.seconds for _, k in kernels), 2),
                "top": [{"name": name, "compiled": k.compiled, "cached": k.cached,
                         "seconds": round(k.seconds, 2)} for name, k in kernels[:top]],
                "by_phase": {phase: {"compiled": k.compiled, "cached": k.cached,
                                     "seconds": round(k.seconds, 2)}
                             for phase, k in self.phases.items()},
            }

    def line(self, top: int = 3) -> str:
        """``Triton JIT 153 compiled + 20 cached in 412.3 s (k1 40 x 80.1 s, ...; by phase:
        warm up 120 x 300.2 s, ...)``."""
        summary = self.summary(top)
        slowest = ", ".join(f"{k['name']} {k['compiled']} x {k['seconds']:.1f} s"
                            for k in summary["top"] if k["compiled"])
        by_phase = ", ".join(f"{phase.replace('_', ' ')} {k['compiled']} x {k['seconds']:.1f} s"
                             for phase, k in summary["by_phase"].items() if k["compiled"])
        details = []
        if slowest:
            details.append(slowest)
        if by_phase:
            details.append(f"by phase: {by_phase}")
        return (f"Triton JIT {summary['compiled']} compiled + {summary['cached']} cached in "
                f"{summary['seconds']:.1f} s" + (f" ({'; '.join(details)})" if details else ""))
