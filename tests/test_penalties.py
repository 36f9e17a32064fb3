"""Presence, frequency and repetition penalties and ``min_tokens``, against a plain reference
of vLLM's definitions: on the sampler's logits, and through ``LLM.generate`` against
transformers' logits."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.layers.penalties import LogitsAdjustments, apply_penalties
from qllm.testing import assert_cache_free, random_prompts

CPU = torch.device("cpu")
VOCAB = 30


def reference_penalties(logits: list[float], params: SamplingParams, prompt: list[int],
                        output: list[int]) -> list[float]:
    """vLLM's penalties on one row, one token at a time."""
    out = list(logits)
    for token in set(prompt) | set(output):
        if params.repetition_penalty != 1:
            value = out[token]
            out[token] = value / params.repetition_penalty if value > 0 \
                else value * params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


ROWS = [  # (params, prompt, output)
    (SamplingParams(presence_penalty=1.5), [1, 2, 2], [3, 3, 4]),
    (SamplingParams(frequency_penalty=-0.7), [5], [6, 6, 6, 7]),
    (SamplingParams(repetition_penalty=1.8), [8, 9, 10], [10, 11]),
    (SamplingParams(), [1, 2, 3], [4, 5]),
    (SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5),
     [12, 13], [13, 14, 14]),
]


@pytest.mark.parametrize("pending", [False, True], ids=["host", "pending-token"])
def test_penalties_match_the_reference(pending):
    """Each row's logits as the reference penalises them; with ``pending`` each row's last
    generated token is still on the device (as with async scheduling)."""
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB) * 3
    params = [p for p, _, _ in ROWS]
    outputs = [out[:-1] if pending else out for _, _, out in ROWS]
    device_tokens = torch.tensor([out[-1] for _, _, out in ROWS])
    adjust = LogitsAdjustments.build(
        params, [prompt for _, prompt, _ in ROWS], outputs,
        (list(range(len(ROWS))), device_tokens) if pending else None,
        [len(out) for _, _, out in ROWS], set(), VOCAB, CPU)
    got = apply_penalties(logits, adjust)
    for row, (p, prompt, output) in enumerate(ROWS):
        want = reference_penalties(logits[row].tolist(), p, prompt, output)
        assert got[row].tolist() == pytest.approx(want, abs=1e-6), f"row {row}"


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(4, VOCAB)
    params = [SamplingParams(min_tokens=3, stop_token_ids=[7]),
              SamplingParams(min_tokens=3, stop_token_ids=[7]),
              SamplingParams(min_tokens=3, ignore_eos=True),
              SamplingParams()]
    adjust = LogitsAdjustments.build(params, [[]] * 4, [[]] * 4, None, [2, 3, 0, 0], {1, 2},
                                     VOCAB, CPU)
    got = apply_penalties(logits, adjust)
    banned = {(r, t) for r, t in zip(*torch.nonzero(got.isinf(), as_tuple=True))}
    assert {(r.item(), t.item()) for r, t in banned} == {(0, 1), (0, 2), (0, 7)}


def test_no_adjustments_without_penalties():
    assert LogitsAdjustments.build([SamplingParams()] * 2, [[1], [2]], [[3], [4]], None,
                                   [1, 1], {1}, VOCAB, CPU) is None


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    path, _ = qwen3_checkpoint
    return LLM(path, block_size=16, max_model_len=128)


def test_penalised_greedy_matches_a_reference_over_transformers(qwen3_checkpoint, llm):
    """Greedy rows with each penalty, batched with one without: every token is the argmax
    of transformers' logits penalised by the reference (up to numerical ties)."""
    _, model = qwen3_checkpoint
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **options)
              for options in ({"presence_penalty": 1.0}, {"frequency_penalty": 0.5},
                              {"repetition_penalty": 1.5}, {},
                              {"presence_penalty": 0.3, "frequency_penalty": 0.3,
                               "repetition_penalty": 1.3})]
    prompts = random_prompts([12, 9, 15, 12, 20], vocab_size=40)  # repeats in the prompts
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, params[3], use_tqdm=False)
    changed = [i for i, (a, b) in enumerate(zip(outputs, plain))
               if a["token_ids"] != b["token_ids"]]
    assert 3 not in changed and len(changed) >= 2, "the penalties should change greedy tokens"
    for prompt, p, out in zip(prompts, params, outputs):
        tokens = out["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        for i, token in enumerate(tokens):
            row = reference_penalties(logits[len(prompt) - 1 + i].tolist(), p, prompt,
                                      tokens[:i])
            assert row[token] >= max(row) - 1e-4, f"{p}: token {i}"
    assert_cache_free(llm)


def test_min_tokens_holds_eos_and_stop_strings(llm, monkeypatch):
    prompt = random_prompts([9])
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]["token_ids"]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {full[0]})
    assert llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0]["token_ids"] == full[:1]
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=4),
                        use_tqdm=False)[0]
    assert len(held["token_ids"]) >= 4 and full[0] not in held["token_ids"][:4]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                                                  ignore_eos=True,
                                                  stop_token_ids=[full[1]]),
                           use_tqdm=False)[0]
    assert full[1] not in stopped["token_ids"][:4] and len(stopped["token_ids"]) >= 4
    assert_cache_free(llm)


def test_min_tokens_defers_stop_strings(qwen3_tokenizer_model_dir):
    llm = LLM(qwen3_tokenizer_model_dir, block_size=16, max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0]["text"]
    stop = text[:2]
    assert stop.strip()
    cut = llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert cut["finish_reason"] == "stop" and cut["text"] == ""
    held = llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=5),
        use_tqdm=False)[0]
    assert len(held["token_ids"]) >= 5 and held["text"].startswith(stop)
