"""Block sizes and launch options of the two expert GEMMs, per MoE shape and token count.

Tables live in ``configs/E={E},N={N},K={K}.json``, named by the ``gate_up_proj`` shape
``[E, N = 2 * I, K = H]`` (which also fixes ``down_proj``). Each maps token counts to a
``MoeConfig``; an entry serves every token count above the previous key up to its own, and the
largest key also serves everything above it. ``benchmarks/bench_moe.py --tune`` writes these
tables on a GPU. Shapes without a table use ``default_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM; ``BLOCK_N`` counts output columns (for the gated GEMM,
    intermediate columns: the program reads ``2 * BLOCK_N`` weight rows, gate and up).
    ``programs_per_sm`` (the small-batch path's gate-up only): at most that many programs per
    multiprocessor, each computing every so many tiles; 0, one program per tile."""

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 0


@dataclass(frozen=True)
class MoeConfig:
    """``BLOCK_M`` (slots per block, shared by the sort and both GEMMs) and each GEMM's tiles.

    ``BLOCK_M`` 1 selects the small-batch path (``triton_slot_moe``): one program per slot and
    no sort; its GEMMs' ``BLOCK_N`` counts weight rows per program (``GROUP_M`` is unused).
    There ``persistent_programs_per_sm`` above 0 runs both GEMMs in one persistent kernel of at
    most that many programs per multiprocessor, on the ``up`` tile's warps and stages; and with
    two kernels, ``prefetch_down`` has each gate-up tile ask the L2 cache for its share of the
    down's weights once its own are read (``triton_slot_moe._prefetch_down_rows``)."""

    BLOCK_M: int
    up: GemmConfig
    down: GemmConfig
    persistent_programs_per_sm: int = 0
    prefetch_down: bool = False

    @classmethod
    def from_json(cls, entry: dict) -> MoeConfig:
        return cls(entry["BLOCK_M"], GemmConfig(**entry["up"]), GemmConfig(**entry["down"]),
                   entry.get("persistent_programs_per_sm", 0), entry.get("prefetch_down", False))

    def to_json(self) -> dict:
        persistent = self.persistent_programs_per_sm
        return {"BLOCK_M": self.BLOCK_M, "up": dataclasses.asdict(self.up),
                "down": dataclasses.asdict(self.down),
                **({"persistent_programs_per_sm": persistent} if persistent else {}),
                **({"prefetch_down": True} if self.prefetch_down else {})}


def config_path(num_experts: int, n: int, k: int, directory: Path = CONFIG_DIR) -> Path:
    """The table for ``gate_up_proj [E, N, K]`` in ``directory`` (this package's tables are
    for bf16 / fp16 weights; a weight-format plugin keeps its own beside its kernels)."""
    return directory / f"E={num_experts},N={n},K={k}.json"


@functools.cache
def load_table(num_experts: int, n: int, k: int,
               directory: Path = CONFIG_DIR) -> dict[int, MoeConfig] | None:
    """``{max tokens: config}`` sorted by key, or ``None`` when the shape has no table in
    ``directory``."""
    path = config_path(num_experts, n, k, directory)
    if not path.is_file():
        return None
    entries = json.loads(path.read_text())["configs"]
    return {int(key): MoeConfig.from_json(entries[key]) for key in sorted(entries, key=int)}


# Where slots rarely share an expert, skipping the sort pays: at Qwen3.5-35B-A3B's shape on
# the H200 the small-batch path won at 1 and 4 tokens (bench_moe.py --tune, 2026-11-30)
SLOT_PATH_MAX_TOKENS = 4


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeConfig:
    """Untuned fallback: the small-batch path for a few tokens, then 16-row blocks while
    experts see few tokens (decode: weight reads dominate), larger tiles once they see many
    (prefill: compute dominates)."""
    if num_tokens <= SLOT_PATH_MAX_TOKENS:
        return MoeConfig(1, GemmConfig(8, 256, num_stages=2), GemmConfig(8, 256, num_stages=2))
    if num_tokens * top_k <= 32 * num_experts:
        return MoeConfig(16, GemmConfig(64, 128), GemmConfig(128, 128))
    return MoeConfig(64, GemmConfig(64, 64), GemmConfig(128, 64))


def get_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int,
               directory: Path = CONFIG_DIR) -> MoeConfig:
    """The config for ``num_tokens`` tokens through ``gate_up_proj [E, N, K]`` with top-k,
    from the table in ``directory`` (``default_config`` without one)."""
    table = load_table(num_experts, n, k, directory)
    if table is None:
        return default_config(num_tokens, num_experts, top_k)
    for max_tokens, config in table.items():
        if num_tokens <= max_tokens:
            return config
    return config
