"""The GEMV sweep's fastest launch configs per GPU model and shape, which the launch takes over
the rule (``configs.default_config``) where the table has one.

``benchmarks/bench_linear.py --sweep --write-table`` times every candidate of
``configs.candidates`` on a GPU and writes the fastest per ``(rows, N, K)`` to
``swept_gemv.json`` under the GPU's name (``torch.cuda.get_device_name``), with its time and the
rule's, replacing that GPU's entry for the shape. Shapes and GPUs without an entry keep the
rule. ``QLLM_GEMV_SWEPT=0`` (``qllm.switches``, read at import) takes the rule everywhere, to
measure one against the other. Pure Python, so the tests read it without a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from pathlib import Path

from qllm.switches import env_switch
from qllm_kernels_linear.configs import GemvConfig

TABLE_PATH = Path(__file__).with_name("swept_gemv.json")
SWITCH_ENV = "QLLM_GEMV_SWEPT"
SWEPT = env_switch(SWITCH_ENV)
CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(GemvConfig))
NOTE = ("The GEMV sweep's fastest config per GPU and (rows, N, K), alone in a CUDA graph with "
        "the L2 flushed; us: its time (null: set by hand for an end-to-end trial, "
        "--set-config), rule_us: the rule's (null: not timed or not among the candidates). "
        "Written by plugins/kernels_linear/benchmarks/bench_linear.py --sweep --write-table; "
        "read by qllm_kernels_linear.swept.")


def shape_key(m: int, n: int, k: int) -> str:
    return f"{m},{n},{k}"


@functools.cache
def load(device_name: str) -> dict[str, GemvConfig]:
    """The table's configs for GPU ``device_name`` by ``shape_key`` (none where the file or
    the GPU has no entry)."""
    if not TABLE_PATH.is_file():
        return {}
    entries = json.loads(TABLE_PATH.read_text())["devices"].get(device_name, {})
    return {key: GemvConfig(**{name: entry[name] for name in CONFIG_FIELDS})
            for key, entry in entries.items()}


def swept_config(m: int, n: int, k: int, device_name: str | None) -> GemvConfig | None:
    """The sweep's config for ``m`` rows through ``weight [n, k]`` on GPU ``device_name``
    (None: not a GPU), or None where the table has none or ``QLLM_GEMV_SWEPT=0``."""
    if not SWEPT or device_name is None:
        return None
    return load(device_name).get(shape_key(m, n, k))


def record(device_name: str, m: int, n: int, k: int, config: GemvConfig, us: float | None,
           rule_us: float | None) -> None:
    """Write ``config`` (``us`` per call, None where it was set by hand untimed; the rule's
    ``rule_us``) as the config for ``m`` rows through ``weight [n, k]`` on GPU
    ``device_name``, keeping every other entry."""
    document = (json.loads(TABLE_PATH.read_text()) if TABLE_PATH.is_file()
                else {"note": NOTE, "devices": {}})
    entries = document["devices"].setdefault(device_name, {})
    entries[shape_key(m, n, k)] = {**dataclasses.asdict(config), "us": us, "rule_us": rule_us,
                                   "date": datetime.date.today().isoformat()}
    document["devices"][device_name] = dict(sorted(entries.items()))
    TABLE_PATH.write_text(json.dumps(document, indent=1) + "\n")
    load.cache_clear()
