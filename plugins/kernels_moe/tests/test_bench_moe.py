"""bench_moe.py's hand-set table entry (``--set-entry``): the tiles written into one entry of a
copy of the shipped table, everything else kept."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_moe import EXPERTS, HIDDEN, INTER, parse_tile, set_entry  # noqa: E402
from qllm_kernels_moe.configs import GemmConfig, config_path, load_table  # noqa: E402


def test_set_entry_rewrites_one_entry_of_a_table(tmp_path):
    path = config_path(EXPERTS, 2 * INTER, HIDDEN, tmp_path)
    shutil.copy(config_path(EXPERTS, 2 * INTER, HIDDEN), path)
    before = json.loads(path.read_text())

    replaced = set_entry(1, ["up=2,2048,4,1,3", "down=8,512,2,1", "persistent=6", "prefetch=1"],
                         path)

    after = json.loads(path.read_text())
    assert replaced == before["configs"]["1"]
    entry = after["configs"]["1"]
    assert entry["tuned_on"] is None and "tuned_ms" not in entry
    assert "chosen_end_to_end" not in entry  # the shipped one-token entry's, of other tiles
    assert entry["BLOCK_M"] == replaced["BLOCK_M"]
    table = load_table(EXPERTS, 2 * INTER, HIDDEN, tmp_path)
    assert table[1].up == GemmConfig(2, 2048, replaced["up"]["GROUP_M"], 4, 1,
                                     programs_per_sm=3)
    assert table[1].down == GemmConfig(8, 512, replaced["down"]["GROUP_M"], 2, 1)
    assert table[1].persistent_programs_per_sm == 6 and table[1].prefetch_down
    assert {k: v for k, v in after["configs"].items() if k != "1"} == \
        {k: v for k, v in before["configs"].items() if k != "1"}
    assert {k: v for k, v in after.items() if k != "configs"} == \
        {k: v for k, v in before.items() if k != "configs"}


@pytest.mark.parametrize("spec", ["up=2,2048,4", "gate=2,2048,4,1", "up=2,x,4,1", "2,2048,4,1",
                                  "up=2,2048,4,1,3,1"])
def test_bad_tiles_are_refused(spec):
    with pytest.raises(ValueError, match="BLOCK_N,BLOCK_K"):
        parse_tile(spec)


def test_an_entry_the_table_lacks_is_refused(tmp_path):
    path = config_path(EXPERTS, 2 * INTER, HIDDEN, tmp_path)
    shutil.copy(config_path(EXPERTS, 2 * INTER, HIDDEN), path)
    with pytest.raises(ValueError, match="no entry for 3 tokens"):
        set_entry(3, ["up=2,2048,4,1"], path)
