"""Bad input to ``qllm serve`` gets an OpenAI error body with the documented status (never a
500), and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from server_fixtures import (  # noqa: F401
    MAX_MODEL_LEN,
    MODEL_NAME,
    check_error_body,
    server,
    tiny_model_dir,
)

M = MODEL_NAME
USER = [{"role": "user", "content": "hi"}]
NAN_TEMPERATURE = b'{"model": "qwen3-tiny", "prompt": "hi", "temperature": NaN}'

# (endpoint, body: a dict sent as JSON or raw bytes, status, the error's param)
BAD_REQUESTS = {
    "malformed JSON": ("completions", b'{"model": "x", "prompt": ', 400, None),
    "not UTF-8": ("completions", b'{"model": "\xff\xfe"}', 400, None),
    "body not an object": ("completions", [M, "hi"], 422, None),
    "empty body": ("completions", b"", 422, None),
    "missing model": ("completions", {"prompt": "hi"}, 422, "model"),
    "missing prompt": ("completions", {"model": M}, 422, "prompt"),
    "max_tokens a string": ("completions", {"model": M, "prompt": "hi", "max_tokens": "5"},
                            422, "max_tokens"),
    "max_tokens a float": ("completions", {"model": M, "prompt": "hi", "max_tokens": 2.5},
                           422, "max_tokens"),
    "temperature a string": ("completions", {"model": M, "prompt": "hi",
                                             "temperature": "hot"}, 422, "temperature"),
    "stream a string": ("completions", {"model": M, "prompt": "hi", "stream": "yes"}, 422,
                        "stream"),
    "prompt a number": ("completions", {"model": M, "prompt": 5}, 422, "prompt"),
    "stop a number": ("completions", {"model": M, "prompt": "hi", "stop": 3}, 422, "stop"),
    "unknown model": ("completions", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    "empty prompt": ("completions", {"model": M, "prompt": ""}, 400, "prompt"),
    "empty prompt list": ("completions", {"model": M, "prompt": []}, 400, "prompt"),
    "prompt too long": ("completions", {"model": M, "prompt": [11] * MAX_MODEL_LEN}, 400,
                        "prompt"),
    "text prompt too long": ("completions", {"model": M, "prompt": "hello " * MAX_MODEL_LEN},
                             400, "prompt"),
    "token id outside the vocabulary": ("completions", {"model": M, "prompt": [1, 10**9]},
                                        400, "prompt"),
    "negative token id": ("completions", {"model": M, "prompt": [1, -1]}, 400, "prompt"),
    "max_tokens beyond max_model_len": ("completions", {"model": M, "prompt": "hi",
                                                        "max_tokens": MAX_MODEL_LEN},
                                        400, "max_tokens"),
    "max_tokens 0": ("completions", {"model": M, "prompt": "hi", "max_tokens": 0}, 422,
                     "max_tokens"),
    "temperature < 0": ("completions", {"model": M, "prompt": "hi", "temperature": -0.5},
                        422, "temperature"),
    "temperature > 2": ("completions", {"model": M, "prompt": "hi", "temperature": 2.5},
                        422, "temperature"),
    "top_p 0": ("completions", {"model": M, "prompt": "hi", "top_p": 0}, 422, "top_p"),
    "top_p > 1": ("completions", {"model": M, "prompt": "hi", "top_p": 1.5}, 422, "top_p"),
    "top_k -2": ("completions", {"model": M, "prompt": "hi", "top_k": -2}, 422, "top_k"),
    "top_k 0": ("completions", {"model": M, "prompt": "hi", "top_k": 0}, 400, "top_k"),
    "n 0": ("completions", {"model": M, "prompt": "hi", "n": 0}, 422, "n"),
    "n 129": ("completions", {"model": M, "prompt": "hi", "n": 129}, 422, "n"),
    "negative seed": ("completions", {"model": M, "prompt": "hi", "seed": -1}, 422, "seed"),
    "huge seed": ("completions", {"model": M, "prompt": "hi", "seed": 2**64}, 422, "seed"),
    "empty stop string": ("completions", {"model": M, "prompt": "hi", "stop": [""]}, 400,
                          "stop"),
    "logprobs 21": ("completions", {"model": M, "prompt": "hi", "logprobs": 21}, 400,
                    "logprobs"),
    "logprobs -1": ("completions", {"model": M, "prompt": "hi", "logprobs": -1}, 400,
                    "logprobs"),
    "logprobs a bool": ("completions", {"model": M, "prompt": "hi", "logprobs": True}, 422,
                        "logprobs"),
    "echo a string": ("completions", {"model": M, "prompt": "hi", "echo": "yes"}, 422, "echo"),
    "presence_penalty 2.5": ("completions", {"model": M, "prompt": "hi",
                                             "presence_penalty": 2.5}, 400, "presence_penalty"),
    "frequency_penalty -3": ("completions", {"model": M, "prompt": "hi",
                                             "frequency_penalty": -3}, 400,
                             "frequency_penalty"),
    "repetition_penalty 0": ("completions", {"model": M, "prompt": "hi",
                                             "repetition_penalty": 0}, 400,
                             "repetition_penalty"),
    "min_tokens -1": ("completions", {"model": M, "prompt": "hi", "min_tokens": -1}, 400,
                      "min_tokens"),
    "min_tokens above max_tokens": ("completions", {"model": M, "prompt": "hi",
                                                    "max_tokens": 4, "min_tokens": 5}, 400,
                                    "min_tokens"),
    "NaN temperature": ("completions", NAN_TEMPERATURE, 422, "temperature"),
    "chat: missing messages": ("chat/completions", {"model": M}, 422, "messages"),
    "chat: no messages": ("chat/completions", {"model": M, "messages": []}, 422, "messages"),
    "chat: unknown role": ("chat/completions", {"model": M, "messages": [
        {"role": "wizard", "content": "hi"}]}, 422, "messages.0.role"),
    "chat: content a number": ("chat/completions", {"model": M, "messages": [
        {"role": "user", "content": 5}]}, 422, "messages.0.content"),
    "chat: unknown model": ("chat/completions", {"model": "gpt-5", "messages": USER}, 404,
                            "model"),
    "chat: max_tokens beyond": ("chat/completions", {"model": M, "messages": USER,
                                                     "max_tokens": MAX_MODEL_LEN}, 400,
                                "max_tokens"),
    "chat: max_completion_tokens beyond": ("chat/completions", {
        "model": M, "messages": USER, "max_completion_tokens": MAX_MODEL_LEN}, 400,
        "max_tokens"),
    "chat: too long": ("chat/completions", {"model": M, "messages": [
        {"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, 400, "messages"),
    "chat: message without content": ("chat/completions", {"model": M, "messages": [
        {"role": "user"}]}, 422, "messages.0.content"),
    "chat: null content": ("chat/completions", {"model": M, "messages": [
        {"role": "user", "content": None}]}, 422, "messages.0.content"),
    "chat: top_logprobs 21": ("chat/completions", {"model": M, "messages": USER,
                                                   "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs"),
    "chat: top_logprobs without logprobs": ("chat/completions", {
        "model": M, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    "chat: logprobs an int": ("chat/completions", {"model": M, "messages": USER,
                                                   "logprobs": 5}, 422, "logprobs"),
    "chat: presence_penalty 3": ("chat/completions", {"model": M, "messages": USER,
                                                      "presence_penalty": 3}, 400,
                                 "presence_penalty"),
}
# Fields of OpenAI's schemas (and vLLM's) the server does not implement: a 400 naming the
# field, not a 200 that ignored it (field: (endpoint, a value that is not neutral)).
UNSUPPORTED = {
    "echo": ("chat/completions", True), "top_logprobs": ("completions", 2),
    "best_of": ("completions", 2), "suffix": ("completions", "!"),
    "logit_bias": ("completions", {"11": 5}), "min_p": ("completions", 0.1),
    "tools": ("chat/completions", [{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": ("chat/completions", "required"),
    "response_format": ("chat/completions", {"type": "json_object"}),
    "max_token": ("completions", 5),  # a typo of max_tokens
}
for name, (endpoint, value) in UNSUPPORTED.items():
    body = {"model": M, "prompt": "hi"} if endpoint == "completions" else {"model": M,
                                                                         "messages": USER}
    BAD_REQUESTS[f"unsupported {name}"] = (endpoint, {**body, name: value}, 400, name)
BAD_REQUESTS["unsupported messages.0.name"] = ("chat/completions", {"model": M, "messages": [
    {**USER[0], "name": "bob"}]}, 400, "messages.0.name")
BAD_REQUESTS["unsupported stream_options field"] = ("completions", {
    "model": M, "prompt": "hi", "stream_options": {"continuous_usage_stats": True}}, 400,
    "stream_options.continuous_usage_stats")


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS.values(),
                         ids=BAD_REQUESTS.keys())
def test_bad_request_gets_an_openai_error(server, endpoint, body, status,  # noqa: F811
                                          param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for stream in (False, True):  # a stream fails the same way, before it starts
        if stream and isinstance(body, dict):
            content = json.dumps({"stream": True, **body}).encode()
        response = httpx.post(f"{server.base_url}/v1/{endpoint}", content=content, timeout=30,
                              headers={"content-type": "application/json"})
        error = check_error_body(response, status)
        assert error["param"] == param
        if status == 404:
            assert error["code"] == "model_not_found"


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/completions", 405),
                                                  ("POST", "/v1/models", 405),
                                                  ("GET", "/v1/nothing", 404)])
def test_wrong_route_gets_an_openai_error(server, method, path, status):  # noqa: F811
    check_error_body(httpx.request(method, f"{server.base_url}{path}"), status)


def test_openai_client_raises_the_matching_errors(server):  # noqa: F811
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=M, prompt="hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=M, messages=USER, temperature=-1)


def test_server_still_answers_correctly_after_bad_requests(server):  # noqa: F811
    body = {"model": M, "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}

    def answer() -> str:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
        return response.json()["choices"][0]["text"]

    before = answer()
    for endpoint, bad, _, _ in BAD_REQUESTS.values():
        content = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        httpx.post(f"{server.base_url}/v1/{endpoint}", content=content,
                   headers={"content-type": "application/json"})
    assert answer() == before
    assert server.wait_until_idle(1.0)


def test_unsupported_fields_at_their_neutral_values_are_accepted(server):  # noqa: F811
    """What clients send when they mean "off" (null, 0, false, {}) changes nothing."""
    body = {"model": M, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    neutral = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None,
               "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "repetition_penalty": 1, "min_tokens": 0, "top_logprobs": 0,
               "user": "someone"}
    texts = []
    for extra in ({}, neutral):
        response = httpx.post(f"{server.base_url}/v1/completions", json={**body, **extra},
                              timeout=30)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    chat = {"model": M, "messages": USER, "max_tokens": 4, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0,
            "echo": False}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=30)
    assert response.status_code == 200, response.text


def test_openai_client_gets_bad_request_for_unsupported_fields(server):  # noqa: F811
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="best_of is not supported"):
        client.completions.create(model=M, prompt="hi", best_of=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=M, messages=USER, logit_bias={"11": 5})
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be"):
        client.chat.completions.create(model=M, messages=USER, logprobs=True, top_logprobs=21)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_aborted_requests_end_with_an_openai_finish_reason(server, stream):  # noqa: F811
    """Requests aborted (as at shutdown, after the grace period) once ended with "abort",
    which OpenAI's schema does not have; they now end with "length": cut short."""
    body = {"model": M, "prompt": "Count slowly", "max_tokens": 80, "ignore_eos": True,
            "temperature": 0, "n": 2, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}

    async def abort_while_generating() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            request = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not server.engine.scheduler.running and not request.done():
                await asyncio.sleep(0.005)
            server.server.async_engine.abort_all()
            response = await request
        assert response.status_code == 200, response.text
        if not stream:
            return [response.json()]
        lines = [line[len("data: "):] for line in response.text.splitlines()
                 if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    chunks = asyncio.run(abort_while_generating())
    reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]
               if choice["finish_reason"]]
    assert reasons == ["length", "length"]
    assert chunks[-1]["usage"]["completion_tokens"] < 2 * 80  # aborted, not finished
    assert server.wait_until_idle(1.0)
