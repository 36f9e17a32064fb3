"""The ``qllm generate`` command."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from qllm import LLM, SamplingParams, __version__
from qllm.cli import main
from qllm.testing import require_qwen3_plugin


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


@pytest.mark.parametrize("options, message", [
    pytest.param(["--kv-cache-memory-bytes", "10"], "fewer than", id="cache-too-small"),
    pytest.param(["--device", "gpu"], "device must be", id="device-gpu"),
    pytest.param(["--dtype", "int8"], "unknown dtype", id="dtype-int8"),
    pytest.param(["--temperature", "nan"], "temperature must be a finite", id="nan"),
])
def test_bad_options_get_one_error_line_not_a_traceback(qwen3_dir, capsys, options, message):
    code = main(["generate", "--model", qwen3_dir, "--prompt", "x", "--max-tokens", "2",
                 *options])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(f"^qllm: error: .*{message}", err, re.MULTILINE), err
    assert "Traceback" not in err


def test_model_that_is_not_a_local_directory(qwen3_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", os.path.join(qwen3_dir, "config.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["generate", "--model", "Qwen/Qwen3-0.6B"]) == 2
    assert "serves only local directories" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"qllm {__version__}"


def test_python_dash_m_qllm_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "qllm", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"qllm {__version__}"


def option_helps(text: str) -> dict[str, str]:
    """Each option of a ``--help`` text with its help, joined onto one line."""
    helps, current = {}, None
    for line in text.splitlines():
        match = re.match(r"  (--[\w-]+)", line)
        if match:
            current = match.group(1)
            helps[current] = line
        elif current and line.startswith("   "):
            helps[current] += " " + line.strip()
        else:
            current = None
    return helps


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_shows_every_option_with_its_default(command, capsys, monkeypatch):
    if command == "serve":
        pytest.importorskip("fastapi")
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    helps = option_helps(capsys.readouterr().out)
    assert {"--model", "--dtype", "--max-num-seqs", "--block-size"} <= set(helps)
    missing = [option for option, text in helps.items()
               if option != "--help" and "(default" not in text]
    assert not missing, missing
    assert "(default: 256)" in helps["--max-num-seqs"]  # EngineConfig's own default
    assert "auto" in helps["--dtype"]


def test_kernel_choice_is_logged_at_debug_only(qwen3_tokenizer_model_dir, caplog):
    """The chosen kernel of every op made one long INFO line at each start."""
    caplog.set_level(logging.DEBUG, logger="qllm")
    assert main(["generate", "--model", qwen3_tokenizer_model_dir, "--prompt", "x",
                 "--max-tokens", "2"]) == 0
    kernel_lines = [r for r in caplog.records if "paged_attention_decode" in r.getMessage()]
    assert kernel_lines and all(r.levelno == logging.DEBUG for r in kernel_lines)


def test_serve_without_the_extra_points_at_the_source_tree(monkeypatch, capsys):
    """The hint named `qllm[serve]`, which pip resolves to an unrelated PyPI project."""
    from qllm.cli.serve import run_serve

    monkeypatch.setitem(sys.modules, "qllm.server.api_server", None)
    assert run_serve(None) == 1
    err = capsys.readouterr().err
    assert 'pip install -e ".[serve]"' in err and "qllm[serve]" not in err
