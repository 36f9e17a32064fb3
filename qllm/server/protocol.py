"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly: a value of the wrong JSON type (``"max_tokens": "5"``) or
outside the documented range is rejected with 422 before it reaches the engine. Fields the
server does not know are ignored, as OpenAI clients send optional fields freely.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_SEED = 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions; ``None`` means the default."""

    model: str
    n: int | None = Field(None, ge=1, le=128, description="choices per prompt")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 disables; 0 is invalid")
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="choice i of a request samples with seed + i")
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch of prompts (text or token ids)."""

    prompt: str | list[str] | list[int] | list[list[int]]


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered by the tokenizer's template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")


# ------------------------------------------------------------------------------ responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "qllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
