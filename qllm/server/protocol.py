"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly: a value of the wrong JSON type (``"max_tokens": "5"``) or
outside the documented range is rejected with 422 before it reaches the engine. A field this
server does not implement (``best_of``, ``logit_bias``, ``tools``...) is kept in
``model_extra`` and, unless sent with its neutral value, rejected with 400 by
``unsupported_fields``, as OpenAI rejects unrecognized arguments: a silent 200 would be an
answer to a different question.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from qllm.engine.llm import CHAT_ROLES

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's limit of top_logprobs (and vLLM's default max_logprobs)

# Fields of OpenAI's completions and chat-completions schemas (and vLLM's extensions) that this
# server does not implement (echo and top_logprobs: in chat / completions, which lack them),
# with the value that leaves each off. A request may send that
# value or null; any other value gets a 400 until the field is implemented.
NEUTRAL_VALUES = {
    "best_of": 1, "echo": False, "suffix": "", "top_logprobs": 0, "logit_bias": {},
    "min_p": 0, "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "none", "parallel_tool_calls": True, "tool_calls": [],
    "response_format": {"type": "text"}, "modalities": ["text"], "store": False,
    "detail": "auto",
}
# Fields that do not change what is generated (ids of the end user): accepted and ignored.
IGNORED_FIELDS = frozenset({"user", "safety_identifier"})


def unsupported_fields(request: BaseModel, path: str = "") -> Iterator[str]:
    """The dotted paths (``presence_penalty``, ``messages.0.name``) of the fields sent in
    ``request`` or its nested parts that this server does not implement, neutral values
    excepted."""
    for name, value in (request.model_extra or {}).items():
        if name not in IGNORED_FIELDS and not _is_neutral(name, value):
            yield path + name
    for name in request.model_fields_set:
        value = getattr(request, name)
        parts = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, part in parts:
            if isinstance(part, BaseModel):
                yield from unsupported_fields(
                    part, f"{path}{name}." if index is None else f"{path}{name}.{index}.")


def _is_neutral(name: str, value) -> bool:
    """``value`` is null or the field's neutral value (0 and False kept apart)."""
    if value is None:
        return True
    neutral = NEUTRAL_VALUES.get(name, ...)
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


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
    # ranges checked by the server (400 naming the field): penalties in [-2, 2],
    # repetition_penalty > 0, 0 <= min_tokens <= max_tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="vLLM's; 1 is off")
    min_tokens: int | None = Field(None, description="vLLM's; EOS and stop strings wait")
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probs per generated token, or None when none are asked for."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch of prompts (text or token ids)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, description=f"0 to {MAX_LOGPROBS} top log-probs")
    echo: bool = False

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextContentPart(_Request):
    type: Literal["text"]
    text: str

    def part(self) -> dict:
        return {"type": "text", "text": self.text}


class ImageURL(_Request):
    url: str = Field(description="a data URL (data:image/png;base64,...); remote URLs are "
                                 "not fetched")


class ImageURLContentPart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL

    def part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url.url}}


class InputAudio(_Request):
    data: str = Field(description="the base64 of a WAV file at the model's sampling rate")
    format: str = Field(description="'wav'")


class InputAudioContentPart(_Request):
    type: Literal["input_audio"]
    input_audio: InputAudio

    def part(self) -> dict:
        return {"type": "input_audio", "input_audio": {"data": self.input_audio.data,
                                                       "format": self.input_audio.format}}


ContentPart = Annotated[TextContentPart | ImageURLContentPart | InputAudioContentPart,
                        Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal[CHAT_ROLES]
    content: str | list[ContentPart]


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered by the tokenizer's template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, description=f"0 to {MAX_LOGPROBS}; needs logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ------------------------------------------------------------------------------ responses
FinishReason = Literal["stop", "length"]  # of OpenAI's values, the two this server produces


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """The legacy completions format: per token its text, log-prob (None for an echoed
    prompt's first token), top log-probs by token text, and offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


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
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TranscriptionResponse(BaseModel):
    """``POST /v1/audio/transcriptions`` with ``response_format`` json."""

    text: str


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
