"""The FastAPI app and the uvicorn server of ``qllm serve``.

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/audio/transcriptions``
(a multipart form; see ``openai_serving`` for their status codes). Every error, the framework's own included, has an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from qllm import __version__
from qllm.engine.llm_engine import LLMEngine
from qllm.server.async_engine import AsyncEngine
from qllm.server.openai_serving import APIError, OpenAIServing
from qllm.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    TranscriptionResponse,
)

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse, "description": description}
           for status, description in [(400, "Bad request"), (404, "Unknown model"),
                                       (422, "Body does not match the schema"),
                                       (503, "Shutting down")]}
# The form fields of POST /v1/audio/transcriptions this server reads; any other is a 400
TRANSCRIPTION_FIELDS = frozenset({"file", "model", "language", "prompt", "response_format",
                                  "temperature"})
# and those sent at their neutral value (OpenAI's defaults), accepted
TRANSCRIPTION_NEUTRAL = {"stream": "false", "timestamp_granularities[]": "segment"}
_STREAM = {200: {"description": "A JSON body, or server-sent events with `stream: true`",
                 "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def build_app(engine: LLMEngine, served_model_name: str | None = None) -> FastAPI:
    """An app serving ``engine``; its lifespan starts and stops the engine thread.

    The model is named ``served_model_name``, by default the checkpoint directory's name.
    """
    name = served_model_name or os.path.basename(os.path.normpath(engine.config.model))
    async_engine = AsyncEngine(engine)
    serving = OpenAIServing(async_engine, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="qllm", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    _add_error_handlers(app)

    @app.get("/health", responses={503: {"description": "The engine is not running"}})
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(async_engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return serving.models()

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, **_STREAM})
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, **_STREAM})
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    @app.post("/v1/audio/transcriptions", response_model=TranscriptionResponse,
              responses={**_ERRORS, 200: {
                  "description": "`{\"text\"}`, or plain text with `response_format: text`",
                  "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def transcriptions(raw: Request, file: UploadFile = File(
                                 description="a WAV file at the model's sampling rate"),
                             model: str = Form(), language: str | None = Form(None),
                             prompt: str | None = Form(None),
                             response_format: str = Form("json"),
                             temperature: float | None = Form(None, ge=0, le=2)):
        form = await raw.form()
        extra = [key for key in form if key not in TRANSCRIPTION_FIELDS
                 and form.getlist(key) != [TRANSCRIPTION_NEUTRAL.get(key)]]
        return await serving.transcription(raw, await file.read(), model, language or None,
                                           prompt or None, response_format, temperature, extra)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    def error(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body.model_dump(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        if any(p["type"] == "json_invalid" for p in problems):
            return error(APIError(400, "the request body is not valid JSON"))
        message = "; ".join(f"{'.'.join(map(str, p['loc'][1:])) or 'body'}: {p['msg']}"
                            for p in problems)
        return error(APIError(422, message, param=_field_path(problems[0]["loc"][1:],
                                                              exc.body)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        response = error(APIError(exc.status_code, str(exc.detail), type=kind))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error(APIError(500, "internal server error", type="server_error"))


def _field_path(loc: tuple, body) -> str | None:
    """The dotted path of the body field an error is about (``messages.0.content``),
    without the union member names pydantic adds to ``loc`` (``prompt.list[int]``)."""
    path = []
    for part in loc:
        if isinstance(body, dict) and isinstance(part, str):
            path.append(part)
            body = body.get(part)
        elif isinstance(body, list) and isinstance(part, int) and 0 <= part < len(body):
            path.append(str(part))
            body = body[part]
        else:
            break
    return ".".join(path) or None


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown (SIGINT/SIGTERM) stops accepting connections, lets the
    requests in flight finish for ``grace_seconds``, then aborts the rest: their streams end
    with finish reason "length" (cut short) and ``[DONE]``, and the engine thread stops."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace_seconds: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.grace_seconds = grace_seconds

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.grace_seconds,
                                                         self.async_engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def create_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000,
                  served_model_name: str | None = None, grace_seconds: float = 10.0,
                  log_level: str = "info") -> GracefulServer:
    """A server for ``engine``; ``.run()`` it (port 0 picks a free port)."""
    app = build_app(engine, served_model_name)
    # The backstop: connections still open this long after the abort are cut.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_seconds + 5)
    return GracefulServer(config, app.state.async_engine, grace_seconds)
