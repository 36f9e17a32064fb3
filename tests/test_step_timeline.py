"""benchmarks/throughput.py's ``StepTimeline``: each prefill step's seconds, sequences and
tokens, as the engine launched them, in a compact summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qllm import LLM, SamplingParams
from qllm.testing import random_prompts, record_launches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from throughput import StepTimeline  # noqa: E402


def test_prefill_steps_report_their_sequences_and_tokens(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, block_size=16, max_model_len=256, max_num_batched_tokens=64)
    engine = llm.engine
    launched = record_launches(engine, monkeypatch)
    timeline = StepTimeline(engine)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(random_prompts([100, 20, 30]), params, use_tqdm=False)

    prefill = timeline.summary()["prefill"]
    shapes = [(seqs, tokens) for is_prefill, seqs, tokens in launched if is_prefill]
    assert list(zip(prefill["step_seqs"], prefill["step_tokens"])) == shapes
    assert shapes[0] == (1, 64), "the 100-token prompt's first chunk fills the step"
    assert prefill["steps"] == len(prefill["step_seconds"]) == len(shapes)
    assert prefill["tokens"] == sum(prefill["step_tokens"]) == 150
    json.dumps(prefill)  # plain numbers only
