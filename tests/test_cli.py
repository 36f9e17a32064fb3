"""The ``qllm generate`` command."""

from __future__ import annotations

import json

from helpers import require_qwen3_plugin
from qllm import LLM, SamplingParams
from qllm.cli import main


def test_generate_prints_text_and_throughput(qwen3_tokenizer_model_dir, capsys):
    code = main(["generate", "--model", qwen3_tokenizer_model_dir, "--prompt", "Hello there",
                 "--prompt", "Bonjour", "--max-tokens", "6", "--ignore-eos", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", "Bonjour"]
    expected = LLM(qwen3_tokenizer_model_dir).generate(
        ["Hello there", "Bonjour"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)
    assert [line["token_ids"] for line in lines] == [e["token_ids"] for e in expected]
    assert [line["text"] for line in lines] == [e["text"] for e in expected]
    assert "tok/s" in captured.err


def test_generate_reports_bad_input_clearly(qwen3_dir, capsys):
    code = main(["generate", "--model", qwen3_dir, "--prompt", "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_default_model_is_built_once_with_random_weights(tmp_path, monkeypatch, capsys):
    require_qwen3_plugin()
    monkeypatch.setenv("QLLM_CACHE", str(tmp_path))
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "RANDOM" in capsys.readouterr().err
    assert (tmp_path / "qwen3-tiny-random" / "model.safetensors").exists()
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos"]) == 0
