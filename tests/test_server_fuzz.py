"""Fuzzing ``qllm serve`` from its own OpenAPI schema (schemathesis: valid and invalid
bodies, wrong methods): no 500, no hang, and every error has an OpenAI error body."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings
from server_fixtures import MODEL_NAME, check_error_body, server, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="module")
def api_schema(server):  # noqa: F811
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_server_error_and_no_hang(case, server):  # noqa: F811
    """Generation is kept short (n <= 2, at most 8 tokens) so the fuzzer explores inputs
    rather than waits on the model, and a string ``model`` is set to the served one so valid
    bodies reach the engine."""
    if isinstance(case.body, dict):
        if isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL_NAME
        case.body.setdefault("max_tokens", 8)
        for key, cap in (("n", 2), ("max_tokens", 8), ("max_completion_tokens", 8)):
            if type(case.body.get(key)) is int and case.body[key] > cap:
                case.body[key] = cap
    response = case.call(timeout=60)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        check_error_body(httpx.Response(response.status_code, content=response.content),
                         response.status_code)
    assert server.wait_until_idle(5.0)
