"""Stop strings through ``qllm serve``: for stop strings of 1 to 64 characters, matching and
never matching, the served text (streamed and not) equals ``LLM.generate``'s text, and that
text is what the generated token ids decode to, cut before the stop string."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from server_fixtures import ENGINE_OPTIONS, server, tiny_model_dir  # noqa: F401

from qllm import LLM, SamplingParams

PROMPT = "Hello"
MAX_TOKENS = 40
STOP_LENGTHS = [1, 2, 3, 5, 8, 12, 13, 21, 34, 52, 64]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # noqa: F811
    return LLM(tiny_model_dir, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def full_text(llm) -> str:
    """The greedy text with no stop string; long enough to cut stop strings of 64 from."""
    text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True), use_tqdm=False)[0]["text"]
    assert len(text) >= 2 * max(STOP_LENGTHS), f"text too short to test: {text!r}"
    return text


def stop_strings(full_text: str) -> list[tuple[str, bool]]:
    """``(stop, matches)`` pairs: a substring of the text, and a string absent from it."""
    cases = []
    for length in STOP_LENGTHS:
        start = (len(full_text) - length) * length // (2 * max(STOP_LENGTHS))
        cases.append((full_text[start:start + length], True))
        never = ("Observation: " * 6)[:length] if length > 1 else "\x07"
        assert never not in full_text
        cases.append((never, False))
    return cases


def test_served_text_equals_offline_text_for_every_stop_length(server, llm, full_text):  # noqa: F811
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    cases = stop_strings(full_text)
    offline = llm.generate([PROMPT] * len(cases), [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
        for stop, _ in cases], use_tqdm=False)
    for (stop, matches), want in zip(cases, offline):
        decoded = llm.tokenizer.decode(want["token_ids"], skip_special_tokens=True)
        if matches:
            assert want["text"] == full_text[:full_text.index(stop)]
            assert decoded.startswith(want["text"] + stop)
            assert want["finish_reason"] == "stop"
        else:
            assert want["text"] == decoded == full_text
            assert want["finish_reason"] == "length"
        args = {"model": server.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0, "stop": [stop], "extra_body": {"ignore_eos": True}}
        whole = client.completions.create(**args).choices[0]
        chunks = list(client.completions.create(**args, stream=True))
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert whole.text == streamed == want["text"], (stop, matches)
        assert whole.finish_reason == chunks[-1].choices[0].finish_reason \
            == want["finish_reason"]
