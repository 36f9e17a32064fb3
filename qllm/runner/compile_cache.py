"""The persistent compile cache: where torch.compile's and Triton's artifacts outlive a launch.

qllm points torch's and Triton's own on-disk caches at one folder per torch and Triton
version under its cache root: ``$QLLM_CACHE_DIR``, else ``~/.cache/qllm``, unless
``EngineConfig.compile_cache_dir`` names another; ``"off"`` in either leaves torch's and
Triton's caches at their own defaults. Under ``<root>/torch-<version>-triton-<version>/``:

- ``inductor/``: Inductor's FX graph cache, AOT autograd cache and the autotune results of its
  kernels (``TORCHINDUCTOR_CACHE_DIR``); a hit skips AOT tracing, lowering and codegen;
- ``triton/``: Triton's compiled kernels, those Inductor generates and the plugins' own
  (``TRITON_CACHE_DIR``), and the choices of ``triton.autotune`` (``TRITON_CACHE_AUTOTUNING``).

Inductor's FX graph and AOT autograd caches are on by default in torch (2.11 and later);
qllm only chooses where they live. Every artifact is keyed by the library that writes it
(torch: the traced graph, its inputs' shapes and dtypes, the compile options, the torch
version and the device; Triton: the kernel source, its constants, the GPU target and the
Triton version), so another model geometry, dtype or qllm version, whose traced graphs
differ, never loads a stale one; qllm writes no file of its own there. Dynamo still traces
every launch, and CUDA graphs are captured anew. (torch's Mega-Cache,
``torch.compiler.save_cache_artifacts``, bundles these same artifacts to move them to another
machine; on one machine the folders already hold them.)
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import torch

DISABLED = "off"
ROOT_ENV = "QLLM_CACHE_DIR"
DEFAULT_ROOT = Path("~/.cache/qllm")
# the cache lookups torch counts: cache -> (counters group, hit, miss and bypass keys)
LOOKUP_COUNTERS = {
    "fx_graph": ("inductor", "fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("aot_autograd", "autograd_cache_hit", "autograd_cache_miss",
                     "autograd_cache_bypass"),
}

# the environment as it was before qllm first pointed it at its cache: a disabled cache
# puts it back, so an engine with the cache off follows torch's defaults even in a process
# where an earlier engine had it on
_replaced_env: dict[str, str | None] = {}


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """Where this process's compile artifacts go: ``folder`` (None when qllm's cache is off)
    with its ``inductor`` and ``triton`` subfolders."""

    folder: Path | None

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    @property
    def triton_folder(self) -> Path | None:
        return self.folder / "triton" if self.folder is not None else None

    def triton_entries(self) -> int | None:
        """How many entries Triton's cache holds (a folder per compiled kernel or autotune
        result); None when off."""
        folder = self.triton_folder
        if folder is None:
            return None
        return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def cache_root(setting: str | None) -> Path | None:
    """qllm's cache root for ``EngineConfig.compile_cache_dir`` = ``setting``: the setting,
    else ``$QLLM_CACHE_DIR`` (an empty value counts as unset), else ``~/.cache/qllm``; None
    when the one that applies is ``"off"``."""
    chosen = setting or os.environ.get(ROOT_ENV) or str(DEFAULT_ROOT)
    if chosen.strip().lower() == DISABLED:
        return None
    return Path(chosen).expanduser().absolute()


def versions_folder() -> str:
    """The cache root's subfolder of this torch and Triton: ``torch-2.13.0-triton-3.7.1``."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = f"torch-{torch.__version__}-triton-{triton_version}"
    return re.sub(r"[^\w.-]", "_", name)


def configure(setting: str | None) -> CompileCache:
    """Point torch's and Triton's caches at qllm's cache for ``compile_cache_dir`` =
    ``setting`` (see the module docstring), or put back what qllm changed when it is off.
    Call before anything compiles; it applies to the whole process."""
    root = cache_root(setting)
    if root is None:
        _set_env({name: value for name, value in _replaced_env.items()})
        return CompileCache(None)
    folder = root / versions_folder()
    _set_env({"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
              "TRITON_CACHE_DIR": str(folder / "triton"),
              "TRITON_CACHE_AUTOTUNING": "1"})
    return CompileCache(folder)


def _set_env(values: dict[str, str | None]) -> None:
    """Set (None: unset) environment variables, remembering the first value qllm replaced;
    Inductor's in-memory caches of loaded artifacts, if it is loaded, are dropped when its
    folder changes."""
    inductor_before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    for name, value in values.items():
        _replaced_env.setdefault(name, os.environ.get(name))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    inductor = sys.modules.get("torch._inductor.utils")  # importing it costs seconds
    if inductor is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") != inductor_before:
        inductor.clear_caches()


def lookups() -> dict[str, dict[str, int]]:
    """torch's cache lookups in this process so far: per cache (``fx_graph``,
    ``aot_autograd``), its hits, misses and bypasses (graphs it could not cache)."""
    from torch._dynamo.utils import counters

    return {cache: {"hits": counters[group][hit], "misses": counters[group][miss],
                    "bypasses": counters[group][bypass]}
            for cache, (group, hit, miss, bypass) in LOOKUP_COUNTERS.items()}


def lookups_since(before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``lookups()`` less the snapshot ``before``."""
    return {cache: {outcome: count - before[cache][outcome] for outcome, count in seen.items()}
            for cache, seen in lookups().items()}


def cache_state(seen: dict[str, dict[str, int]]) -> str:
    """Of Inductor's graphs in ``seen`` (``lookups_since``): ``"warm"`` when every one was
    loaded from the FX graph cache, ``"cold"`` when none was, else ``"partly warm"``;
    ``"unused"`` when nothing was compiled. A graph that Inductor could not cache (a bypass)
    counts as a miss. AOT autograd's own lookups do not count: a frame whose compile dynamo
    restarts misses there on every launch before it reaches Inductor."""
    fx_graph = seen["fx_graph"]
    hits, misses = fx_graph["hits"], fx_graph["misses"] + fx_graph["bypasses"]
    if not hits and not misses:
        return "unused"
    return "warm" if not misses else "cold" if not hits else "partly warm"
