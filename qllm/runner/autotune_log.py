"""Triton autotuning in this process, per kernel: how many tuning keys were tuned and the
seconds their tuning runs took.

A ``triton.autotune``d kernel's first run with a new tuning key compiles and times its candidate
configs (or, with Triton's autotune cache warm, reads the pick from disk) before it launches the
fastest; on a cold machine this is a large part of a hybrid model's start-up (fla's chunked gated
delta rule kernels). ``qllm.runner.parallel_autotune`` records each such run here; a key whose
config is already known (tuned earlier in the process, or pinned, as kernels_gdn pins fla's) is
not a tuning run and is not counted."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class KernelTunes:
    """One kernel's tuning runs: ``keys`` tuned and the ``seconds`` those runs took."""

    keys: int = 0
    seconds: float = 0.0


class AutotuneLog:
    """Tuning runs by kernel name (``record``), summed in ``summary`` and ``line``."""

    def __init__(self):
        self.kernels: dict[str, KernelTunes] = {}

    def record(self, name: str, seconds: float) -> None:
        """Count one tuning run of kernel ``name`` that took ``seconds``."""
        entry = self.kernels.setdefault(name, KernelTunes())
        entry.keys += 1
        entry.seconds += seconds

    def summary(self, top: int = 10) -> dict:
        """Totals (``keys``, ``kernels``, ``seconds``) and the ``top`` kernels by seconds, each
        ``{name, keys, seconds}``."""
        kernels = sorted(self.kernels.items(), key=lambda item: -item[1].seconds)
        return {"keys": sum(k.keys for _, k in kernels), "kernels": len(kernels),
                "seconds": round(sum(k.seconds for _, k in kernels), 2),
                "top": [{"name": name, "keys": k.keys, "seconds": round(k.seconds, 2)}
                        for name, k in kernels[:top]]}

    def line(self, top: int = 3) -> str:
        """``autotuned 12 keys of 9 kernels in 14.2 s (k1 2 x 5.1 s, ...)``."""
        summary = self.summary(top)
        slowest = ", ".join(f"{k['name']} {k['keys']} x {k['seconds']:.1f} s"
                            for k in summary["top"])
        return (f"autotuned {_count(summary['keys'], 'key')} of "
                f"{_count(summary['kernels'], 'kernel')} in {summary['seconds']:.1f} s"
                + (f" ({slowest})" if slowest else ""))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
