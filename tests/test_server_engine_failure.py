"""The engine thread failing while serving (in a step, or handing out a step's outputs): its
requests get a 500 (whole) or an error event (streamed) that names the failure, and the server
goes on answering correctly; after a device error it refuses requests and reports unhealthy."""

from __future__ import annotations

import json

import pytest
import torch

httpx = pytest.importorskip("httpx")

from server_fixtures import MODEL_NAME, running_server, server, tiny_model_dir  # noqa: F401

from qllm.testing import fail_on_call

BODY = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 12,
        "temperature": 0, "ignore_eos": True}


def complete(server, **extra) -> httpx.Response:  # noqa: F811
    return httpx.post(f"{server.base_url}/v1/completions", json={**BODY, **extra}, timeout=30)


def streamed_events(response: httpx.Response) -> list:
    lines = [line[len("data: "):] for line in response.text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", response.text
    return [json.loads(line) for line in lines[:-1]]


FAILING = {  # where the failure is injected: the owner (from the server), the method
    "runner.launch": (lambda server: server.engine.runner, "launch"),
    "scheduler.postprocess": (lambda server: server.engine.scheduler, "postprocess"),
    "async_engine._publish": (lambda server: server.server.async_engine, "_publish"),
}


@pytest.mark.parametrize("failing", FAILING)
def test_engine_failure_fails_its_requests_and_the_server_keeps_serving(
        server, monkeypatch, failing):  # noqa: F811
    before = complete(server)
    assert before.status_code == 200, before.text
    owner_of, method = FAILING[failing]
    owner = owner_of(server)

    fail_on_call(monkeypatch, owner, method, call=3)  # after the prefill step's call
    whole = complete(server)
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["type"] == "server_error"
    assert error["message"].startswith("generation failed: InjectedFailure: "), error
    assert method in error["message"]
    assert server.wait_until_idle(5.0)

    monkeypatch.undo()
    fail_on_call(monkeypatch, owner, method, call=3)
    streamed = complete(server, stream=True)
    assert streamed.status_code == 200  # the failure comes after the headers were sent
    events = streamed_events(streamed)
    assert events[-1]["error"]["type"] == "server_error"
    assert "generation failed: InjectedFailure" in events[-1]["error"]["message"]
    assert server.wait_until_idle(5.0)

    monkeypatch.undo()
    after = complete(server)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert server.wait_until_idle(5.0)


def test_device_error_makes_the_server_refuse_requests_and_report_unhealthy(
        tiny_model_dir, monkeypatch):  # noqa: F811
    """CUDA returns a device error (an illegal address, say) to every later call: serving on
    would fail each request, so the engine stops stepping, answers 503 and /health 503."""
    with running_server(tiny_model_dir) as running:
        assert httpx.get(f"{running.base_url}/health").status_code == 200
        fail_on_call(monkeypatch, running.engine.runner, "launch", call=3,
                     error=torch.AcceleratorError)
        failed = complete(running)
        assert failed.status_code == 500, failed.text
        assert "generation failed: AcceleratorError: " in failed.json()["error"]["message"]
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        refused = complete(running)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert "failed on its device" in message and "restart the server" in message
        assert running.wait_until_idle(5.0)
