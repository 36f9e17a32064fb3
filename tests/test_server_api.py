"""``qllm serve`` end to end: a real server on 127.0.0.1 with a tiny Qwen3, driven by the
official ``openai`` client and by raw HTTP, checked against ``LLM.generate``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import re

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from server_fixtures import ENGINE_OPTIONS, server, tiny_model_dir  # noqa: F401

from qllm import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4", "def main():",
           "Once upon a time", "日本語のテキスト"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:  # noqa: F811
    return LLM(tiny_model_dir, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def greedy(llm: LLM, prompts, max_tokens: int, **extra) -> list[dict]:
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **extra),
                        use_tqdm=False)


def sse_events(lines) -> list:
    """The JSON payloads of server-sent ``data:`` lines; asserts the stream ends in [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(item) for item in data[:-1]]


def metric(text: str, name: str, default: float | None = None) -> float:
    """The value of one sample of the Prometheus text ``text``."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if match is None:
        assert default is not None, f"{name} not in /metrics"
        return default
    return float(match.group(1))


def test_models_and_health(server, client):  # noqa: F811
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_greedy_completions_match_llm_generate(server, client, llm):  # noqa: F811
    expected = greedy(llm, PROMPTS, 24)
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                        temperature=0)
        assert got.choices[0].text == want["text"]
        assert got.choices[0].finish_reason == want["finish_reason"] == "length"
        assert got.usage.prompt_tokens == len(want["prompt_token_ids"])
        assert got.usage.completion_tokens == 24
    batch = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=24,
                                      temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == \
        [want["text"] for want in expected]
    ids = client.completions.create(model=server.model, max_tokens=24, temperature=0,
                                    prompt=expected[0]["prompt_token_ids"])
    assert ids.choices[0].text == expected[0]["text"]


def test_chat_matches_llm_chat(server, client, llm):  # noqa: F811
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 2 + 2?"}]
    want = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=16),
                    use_tqdm=False)[0]
    got = client.chat.completions.create(model=server.model, messages=conversation,
                                         max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.completion_tokens == 16


def test_chat_without_max_tokens_fills_the_context(server, client):  # noqa: F811
    got = client.chat.completions.create(model=server.model, messages=[
        {"role": "user", "content": "Go on forever."}], temperature=0, extra_body={
        "ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.total_tokens == ENGINE_OPTIONS["max_model_len"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_concatenates_to_the_non_streamed_text(server, client, kind):  # noqa: F811
    args = {"model": server.model, "max_tokens": 32, "temperature": 0.8, "seed": 7, "n": 2}
    if kind == "chat":
        create, args["messages"] = client.chat.completions.create, \
            [{"role": "user", "content": "Tell me a story."}]
    else:
        create, args["prompt"] = client.completions.create, "Tell me a story."
    whole = create(**args)
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if kind == "chat" \
                else choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    for choice in whole.choices:
        message = choice.message.content if kind == "chat" else choice.text
        assert texts[choice.index] == message
        assert reasons[choice.index] == choice.finish_reason == "length"
    assert texts[0] != texts[1], "seed + choice index must give distinct choices"
    assert usage == whole.usage


def test_stop_string_cuts_stream_and_text_alike(server, client, llm):  # noqa: F811
    full = greedy(llm, PROMPTS[1], 32)[0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    args = {"model": server.model, "prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0,
            "stop": [stop]}
    assert client.completions.create(**args).choices[0].text == want
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_http_stream_and_usage(server, llm):  # noqa: F811
    want = greedy(llm, PROMPTS[0], 8)[0]
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": len(want["prompt_token_ids"]),
                                   "completion_tokens": 8,
                                   "total_tokens": len(want["prompt_token_ids"]) + 8}


def test_64_concurrent_streams_complete_whole(server, llm):  # noqa: F811
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    expected = [out["text"] for out in greedy(llm, prompts, 12)]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 12,
                "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = sse_events([line async for line in response.aiter_lines()])
        return "".join(e["choices"][0]["text"] for e in events), \
            events[-1]["choices"][0]["finish_reason"]

    async def all_of_them():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == expected
    assert all(reason == "length" for _, reason in results)
    assert server.wait_until_idle(1.0)


def test_disconnected_streams_free_their_cache(server):  # noqa: F811
    aborted = 'qllm_request_finished_total{finish_reason="abort"}'
    aborted_before = metric(httpx.get(f"{server.base_url}/metrics").text, aborted, default=0)

    async def read_a_little_then_leave(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": server.model, "prompt": f"Count to a thousand {i}", "max_tokens": 80,
                "ignore_eos": True, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(3):  # the first events: generation is under way
                await anext(lines)

    async def leave_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            await asyncio.gather(*(read_a_little_then_leave(client, i) for i in range(16)))

    asyncio.run(leave_all())
    assert server.wait_until_idle(1.0), "disconnected requests still hold the cache"
    text = httpx.get(f"{server.base_url}/metrics").text
    assert metric(text, aborted) == aborted_before + 16
    assert metric(text, "qllm_num_requests_running") == 0


def test_disconnected_non_streaming_request_is_aborted(server):  # noqa: F811
    body = {"model": server.model, "prompt": "Go on and on", "max_tokens": 90, "n": 4,
            "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    assert server.wait_until_idle(1.0)


def test_metrics_report_latencies_and_tokens(server, client):  # noqa: F811
    client.completions.create(model=server.model, prompt="metrics", max_tokens=4)
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert metric(text, "qllm_time_to_first_token_seconds_count") >= 1
    assert metric(text, "qllm_inter_token_latency_seconds_count") >= 3
    assert metric(text, "qllm_generation_tokens_total") >= 4
    assert metric(text, "qllm_prompt_tokens_total") >= 1
    assert metric(text, 'qllm_time_to_first_token_seconds_bucket{le="+Inf"}') == \
        metric(text, "qllm_time_to_first_token_seconds_count")
    for name in ("qllm_num_requests_running", "qllm_num_requests_waiting",
                 'qllm_cache_usage_ratio{kind="paged_kv"}'):
        metric(text, name)


def test_http_concurrency_benchmark_runs(server, capsys):  # noqa: F811
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "http_concurrency.py"
    spec = importlib.util.spec_from_file_location("http_concurrency", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--base-url", server.base_url, "--levels", "1,4",
                       "--requests-per-level", "4", "--prompt-tokens", "8",
                       "--max-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["concurrency"] for row in rows] == [1, 4]
    assert all(row["output_tokens"] == 4 * 6 and row["ttft_ms"]["p50"] > 0 for row in rows)
    assert "TTFT p50" in err


def token_texts(llm: LLM, token_ids: list[int]) -> list[str]:
    return [llm.tokenizer.decode([t]) for t in token_ids]


def legacy_logprobs(llm: LLM, token_ids: list[int], entries: list) -> dict:
    """The legacy completions ``logprobs`` object expected for ``LLM.generate``'s tokens."""
    texts = token_texts(llm, token_ids)
    offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]
    tops = [None if entry is None else
            {text: lp.logprob for text, lp in reversed([(llm.tokenizer.decode([t]), lp)
                                                          for t, lp in entry.items()])}
            for entry in entries]
    return {"tokens": texts, "text_offset": offsets, "top_logprobs": tops,
            "token_logprobs": [None if entry is None else entry[t].logprob
                               for t, entry in zip(token_ids, entries)]}


def assert_legacy_logprobs(got, want: dict) -> None:
    got = got.model_dump() if hasattr(got, "model_dump") else got
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert [v is None for v in got["token_logprobs"]] == \
        [v is None for v in want["token_logprobs"]]
    assert [v for v in got["token_logprobs"] if v is not None] == pytest.approx(
        [v for v in want["token_logprobs"] if v is not None], abs=1e-5)
    for top, expected in zip(got["top_logprobs"], want["top_logprobs"]):
        assert (top is None) == (expected is None)
        if top is not None:
            assert set(top) == set(expected)
            assert top == pytest.approx(expected, abs=1e-5)


def merged_legacy(chunks) -> dict:
    """The legacy ``logprobs`` of a streamed choice, its chunks' concatenated."""
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key in merged:
                    merged[key] += getattr(choice.logprobs, key)
    return merged


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_completion_logprobs_through_the_openai_client(server, client, llm, echo):  # noqa: F811
    """logprobs=3 (and echo: the prompt's text and log-probs first), whole and streamed,
    as LLM.generate scores the same tokens."""
    prompt = PROMPTS[1]
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logprobs=3,
                                               prompt_logprobs=3 if echo else None),
                        use_tqdm=False)[0]
    token_ids, entries = want["token_ids"], want["logprobs"]
    if echo:
        token_ids = want["prompt_token_ids"] + token_ids
        entries = want["prompt_logprobs"] + entries
    expected = legacy_logprobs(llm, token_ids, entries)
    args = {"model": server.model, "prompt": prompt, "max_tokens": 10, "temperature": 0,
            "logprobs": 3, "echo": echo}
    whole = client.completions.create(**args).choices[0]
    assert whole.text == (prompt if echo else "") + want["text"]
    assert_legacy_logprobs(whole.logprobs, expected)
    assert all(len(top) in (3, 4) for top in whole.logprobs.top_logprobs if top is not None)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert_legacy_logprobs(merged_legacy(chunks), expected)
    plain = client.completions.create(**{**args, "logprobs": None}).choices[0]
    assert plain.logprobs is None and plain.text == whole.text


def test_chat_logprobs_through_the_openai_client(server, client, llm):  # noqa: F811
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    want = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=12, logprobs=2),
                    use_tqdm=False)[0]
    args = {"model": server.model, "messages": conversation, "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert whole.message.content == want["text"]
    assert [c.token for c in content] == token_texts(llm, want["token_ids"])
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(want["token_ids"], want["logprobs"])], abs=1e-5)
    for c, token, entry in zip(content, want["token_ids"], want["logprobs"]):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:2]
        assert [t.token for t in c.top_logprobs] == token_texts(llm, [t for t, _ in ranked])
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(
            [lp.logprob for _, lp in ranked], abs=1e-5)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    # the bytes of the tokens make up the text, multi-byte characters included
    assert b"".join(bytes(c.bytes) for c in content).decode() == whole.message.content
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    bare = client.chat.completions.create(**{**args, "top_logprobs": None}).choices[0]
    assert all(c.top_logprobs == [] for c in bare.logprobs.content)
    assert client.chat.completions.create(**{**args, "logprobs": False,
                                             "top_logprobs": None}).choices[0].logprobs is None


def test_penalties_and_seeded_choices_match_llm_generate(server, client, llm):  # noqa: F811
    penalties = {"presence_penalty": 1.0, "frequency_penalty": 0.5}
    extra = {"repetition_penalty": 1.3, "min_tokens": 6}
    want = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, **penalties,
                                                   **extra), use_tqdm=False)[0]
    got = client.completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=16,
                                    temperature=0, **penalties, extra_body=extra)
    assert got.choices[0].text == want["text"]
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3, logprobs=1)
    want = llm.generate(PROMPTS[3], seeded, use_tqdm=False)[0]["outputs"]
    got = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=8,
                                    temperature=1.0, seed=5, n=3, logprobs=1)
    for choice in got.choices:
        assert choice.text == want[choice.index]["text"]
        assert choice.logprobs.token_logprobs == pytest.approx(
            [e[t].logprob for t, e in zip(want[choice.index]["token_ids"],
                                          want[choice.index]["logprobs"])], abs=1e-5)


def test_streamed_logprobs_with_a_stop_string(server, client, llm):  # noqa: F811
    """Tokens whose text a possible stop string holds back bring their log-probs in a later
    chunk: the stream's log-probs are the whole response's."""
    full = greedy(llm, PROMPTS[4], 24)[0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    args = {"model": server.model, "prompt": PROMPTS[4], "max_tokens": 24, "temperature": 0,
            "stop": [stop], "logprobs": 2}
    whole = client.completions.create(**args).choices[0]
    assert whole.finish_reason == "stop" and whole.text == full[:full.index(stop)]
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert merged_legacy(chunks) == whole.logprobs.model_dump()
