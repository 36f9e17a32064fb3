"""benchmarks/results.jsonl holds the benchmark history, one JSON object per line;
benchmarks/RESULTS.md holds only the current figures and fits on two screens."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ("date", "commit", "section", "metric", "value", "command")


def test_results_jsonl_rows_parse_with_required_keys():
    lines = (ROOT / "benchmarks" / "results.jsonl").read_text().splitlines()
    assert lines
    for number, line in enumerate(lines, 1):
        row = json.loads(line)
        assert isinstance(row, dict), number
        missing = [key for key in REQUIRED if key not in row]
        assert not missing, f"results.jsonl line {number} lacks {missing}"


def test_results_md_fits_on_two_screens():
    lines = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    assert len(lines) <= 120, f"RESULTS.md has {len(lines)} lines (at most 120)"
