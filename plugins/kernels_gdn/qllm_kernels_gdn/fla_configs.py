"""Launch configs of fla's autotuned kernels, picked once on a GPU and shipped, so that a cold
start neither compiles nor times their other candidates.

fla's chunked gated delta rule (``fla_chunk``) runs about ten ``triton.autotune``d kernels of
4 to 24 candidate configs each; on a fresh machine the first prefill compiles every candidate
for every tuning key and times them (W3's cold start on the H200: 65 of its 80 Triton compiles,
2026-12-03). fla reads picked configs from a folder when ``FLA_CACHE_MODE`` asks it to: one
``{kernel}.json`` per kernel in ``FLA_CONFIG_DIR``, its entries keyed by the hash of Triton's
tuning key (the values of the kernel's key arguments, then its tensor arguments' dtypes; for
these kernels head counts, head dims, chunk size and flags, never a sequence length).

This plugin ships such folders, one per GPU model: ``fla_configs/<GPU name>/`` (the name as
``torch.cuda.get_device_name`` gives it, each run of other characters than letters and digits
one ``_``: ``NVIDIA_H200``). ``write_configs`` writes one after a start-up on that GPU
(``benchmarks/throughput.py --dump-fla-configs``); ``use_shipped_configs``, called before fla is
first imported, points fla at the folder for this GPU in ``strict`` mode: a tuning key found
there takes its config, any other key is autotuned as before. A user's own ``FLA_CACHE_MODE``
or ``FLA_CONFIG_DIR`` stands, and ``QLLM_FLA_CONFIGS=0`` (``qllm.switches``) leaves fla's
default (autotune every key).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

from qllm.runner.parallel_autotune import live_autotuners, tuned_configs
from qllm.switches import env_switch

CONFIG_ROOT = Path(__file__).with_name("fla_configs")
SWITCH_ENV = "QLLM_FLA_CONFIGS"
FLA_ENV = ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")
FLA_CACHE_MODULE = "fla.ops.utils.cache"  # reads FLA_CACHE_MODE once, when imported

logger = logging.getLogger(__name__)


def gpu_folder_name(gpu_name: str) -> str:
    """``gpu_name`` as a folder name: each run of characters other than letters and digits one
    ``_``, none at either end (``"NVIDIA H200"`` -> ``"NVIDIA_H200"``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", gpu_name).strip("_") or "unknown_gpu"


def use_shipped_configs(gpu_name: str) -> Path | None:
    """Point fla at the configs shipped for ``gpu_name`` (``FLA_CACHE_MODE=strict``,
    ``FLA_CONFIG_DIR``) and return their folder; None, changing nothing, where none are shipped
    for it, where ``QLLM_FLA_CONFIGS=0``, where the environment already sets either fla variable
    (the user's choice, or an earlier call's), or where fla is imported already (its cache mode
    was read then: a warning says so)."""
    if not env_switch(SWITCH_ENV) or any(name in os.environ for name in FLA_ENV):
        return None
    folder = CONFIG_ROOT / gpu_folder_name(gpu_name)
    if not folder.is_dir():
        return None
    if FLA_CACHE_MODULE in sys.modules:
        logger.warning("fla was imported before qllm could point it at the configs shipped "
                       "for %s (%s): its kernels autotune as usual", gpu_name, folder)
        return None
    os.environ.update(FLA_CACHE_MODE="strict", FLA_CONFIG_DIR=str(folder))
    logger.info("fla's autotuned kernels take the configs shipped for %s where their tuning "
                "keys are found (%s)", gpu_name, folder)
    return folder


def fla_autotuners() -> list:
    """Every fla autotuner alive in this process (those that read fla's config folders)."""
    from fla.ops.utils.cache import CachedAutotuner

    return live_autotuners(CachedAutotuner)


def write_configs(folder: Path, autotuners=None) -> list[Path]:
    """Write the configs fla's autotuners (``autotuners``; default: every one alive) picked in
    this process, every tuning key they ran, to ``folder`` in fla's format: one
    ``{kernel}.json`` per kernel, replacing any there. Returns the files written."""
    import triton
    from fla.ops.utils.cache import AutotuneKey

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    tuned = tuned_configs(fla_autotuners() if autotuners is None else autotuners)
    for kernel, entries in tuned.items():
        autotune_entries = {
            AutotuneKey.key_hash(entry["key"]): {
                "autotune_key": entry["key"],
                "config": {name: value for name, value in entry.items() if name != "key"}}
            for entry in entries}
        path = folder / f"{kernel}.json"
        path.write_text(json.dumps({"kernel_name": kernel, "triton_version": triton.__version__,
                                    "autotune_entries": autotune_entries}, indent=1) + "\n")
        written.append(path)
    return written
