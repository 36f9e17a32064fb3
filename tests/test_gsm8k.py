"""The GSM8K harness (``benchmarks/gsm8k.py``): lm-eval's prompt and scoring on known
answers, and whole runs on bundled synthetic questions, offline and against ``qllm serve``."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from qllm import LLM, SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "gsm8k_synthetic.jsonl"
spec = importlib.util.spec_from_file_location("gsm8k", ROOT / "benchmarks" / "gsm8k.py")
gsm8k = sys.modules["gsm8k"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(gsm8k)

ENGINE_OPTIONS = {"max_model_len": 512, "block_size": 16, "num_kv_blocks": 256,
                  "max_num_seqs": 16}


def test_prompt_is_lm_evals_few_shot_format():
    shots = [gsm8k.Problem("1 + 1?", "1 + 1 = 2.\n#### 2"), gsm8k.Problem("2 * 3?", "#### 6")]
    assert gsm8k.build_prompt(shots, "5 - 4?") == (
        "Question: 1 + 1?\nAnswer: 1 + 1 = 2.\n#### 2\n\n"
        "Question: 2 * 3?\nAnswer: #### 6\n\n"
        "Question: 5 - 4?\nAnswer:")
    assert gsm8k.build_prompt([], "5 - 4?") == "Question: 5 - 4?\nAnswer:"


@pytest.mark.parametrize("completion, reference, strict, flexible", [
    (" 3 * 4 = 12 pens.\n#### 12", "... #### 12", True, True),
    (" The answer is 12.", "#### 12", False, True),             # no "#### N": strict fails
    (" #### 12\nThen 13 more.", "#### 12", True, False),        # flexible takes the last number
    (" #### 1,200", "so 1200 in all\n#### 1,200", True, True),  # commas ignored both sides
    (" It costs $20.", "#### 20", False, True),                 # "$" and the final "." ignored
    (" #### -4", "#### -4", True, True),
    (" #### 12 and #### 13", "#### 13", False, True),           # strict takes the first
    (" no number here", "#### 7", False, False),
    (" 7", "#### 7", False, True),                              # a single digit: second group
])
def test_scores_known_answers(completion, reference, strict, flexible):
    assert gsm8k.score(completion, reference) == {"strict-match": strict,
                                                  "flexible-extract": flexible}


def test_extract_reports_invalid_without_a_number():
    assert gsm8k.extract("none", gsm8k.STRICT, last=False) == gsm8k.INVALID


def test_malformed_data_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object"):
        gsm8k.load_problems(str(path))


def test_evaluate_averages_the_scores_of_its_records():
    problems = gsm8k.load_problems(str(DATA))[:4]
    answers = {p.question: p.answer for p in problems}
    right = {problems[0].question, problems[1].question}

    def generate(prompts):  # right on two questions, wrong on the others
        questions = [prompt.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
                     for prompt in prompts]
        return [answers[q] if q in right else " #### 0" for q in questions]

    result = gsm8k.evaluate(problems, [], generate, batch_size=3, use_tqdm=False)
    assert result["num_questions"] == 4
    assert result["strict-match"] == result["flexible-extract"] == 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    server_fixtures = pytest.importorskip("server_fixtures")
    return server_fixtures.build_tiny_qwen3(str(tmp_path_factory.getbasetemp()))


def test_offline_and_served_runs_agree(model_dir, tmp_path):
    server_fixtures = pytest.importorskip("server_fixtures")
    common = ["--data", str(DATA), "--num-fewshot", "2", "--max-tokens", "12"]
    offline_out, served_out = tmp_path / "offline.jsonl", tmp_path / "served.jsonl"
    offline = gsm8k.main([*common, "--model", model_dir, "--output", str(offline_out)])
    with server_fixtures.running_server(model_dir, **ENGINE_OPTIONS) as server:
        served = gsm8k.main([*common, "--base-url", server.base_url, "--served-model",
                             server.model, "--concurrency", "4", "--output", str(served_out)])
    offline_records, served_records = ([json.loads(line) for line in out.read_text().splitlines()]
                                       for out in (offline_out, served_out))
    problems = gsm8k.load_problems(str(DATA))
    assert offline["num_questions"] == served["num_questions"] == len(problems) - 2
    assert offline_records == served_records
    assert offline["strict-match"] == served["strict-match"]
    # a completion is the greedy continuation of its prompt, cut at the first stop string
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    prompt = gsm8k.build_prompt(problems[:2], problems[2].question)
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0]["text"]
    cut = min([full.index(s) for s in gsm8k.STOP if s in full], default=len(full))
    assert offline_records[0]["completion"] == full[:cut]
