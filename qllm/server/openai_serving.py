"""The OpenAI completions and chat-completions logic: request -> engine -> response.

Status codes (each with an OpenAI error body, see ``api_server``):

- 400: the body is not valid JSON, or is well-formed but cannot be served: a field this
  server does not implement (``protocol.NEUTRAL_VALUES``) sent with a value other than its
  neutral one, or a field no schema has; a prompt that is empty or has no room to generate
  within ``max_model_len``, ``max_tokens`` beyond what is left of ``max_model_len``, token
  ids outside the vocabulary, ``top_k`` = 0, an empty stop string, ``logprobs`` /
  ``top_logprobs`` outside [0, 20] (``top_logprobs`` without ``logprobs: true``), a
  presence or frequency penalty outside [-2, 2], ``repetition_penalty`` <= 0,
  ``min_tokens`` outside [0, max_tokens], a conversation the chat template rejects; a media
  content part the model does not take, an image URL that is not a data URL, media that do
  not decode or do not fit ``max_model_len``; a transcription for a model without audio
  inputs, an unknown ``language``, a ``response_format`` other than json or text.
- 404: a ``model`` other than the served one.
- 422: the body does not match the schema (missing field, wrong type, value out of range).
- 503: the server is shutting down.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse

from qllm.config import SamplingParams
from qllm.engine.llm import render_chat
from qllm.engine.llm_engine import load_tokenizer
from qllm.model.multimodal import MediaError
from qllm.server.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    GenerationError,
    RequestGroup,
    RequestOutput,
)
from qllm.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from qllm.server.protocol import (
    MAX_LOGPROBS,
    NEUTRAL_VALUES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ImageURLContentPart,
    InputAudioContentPart,
    ModelCard,
    ModelList,
    TranscriptionResponse,
    Usage,
    unsupported_fields,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TRANSCRIPTION_FORMATS = ("json", "text")  # of OpenAI's response_format values, those served
# The engine's finish reasons as OpenAI's: a request aborted at shutdown was cut short, as by
# max_tokens, so "length" (OpenAI's enum has no "abort"; vLLM sends "abort" as is, which
# typed clients fail to parse, see vllm-project/vllm#57082).
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length", None: None}


class APIError(Exception):
    """An error answered with an OpenAI error body and ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param,
                                                  code=code))


class OpenAIServing:
    """Serves one model; the engine thread behind ``engine`` does all the generating."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.engine.config.max_model_len
        # The front end's own tokenizer: the engine thread decodes with the engine's
        # tokenizer at the same time, and a tokenizer is not safe to share across threads.
        self.tokenizer = load_tokenizer(engine.engine.config.model)
        self.token_strings = TokenStrings(self.tokenizer) if self.tokenizer is not None \
            else None
        # and its own instance of the model's media processor (None: a text-only model)
        self.input_processor = engine.engine.model.input_processor(engine.engine.config.model,
                                                                   self.tokenizer)

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    async def completions(self, request: CompletionRequest, raw: Request):
        self._check_request(request)
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "the prompt list is empty", param="prompt")
        prompts = [self._encode(p, "prompt") for p in prompt]
        max_tokens = [self._max_tokens(request.max_tokens, ids, DEFAULT_COMPLETION_MAX_TOKENS)
                      for ids in prompts]
        echoed = None
        if request.echo:  # the prompt as sent; token ids as their text
            echoed = [p if isinstance(p, str) else self._decode(ids)
                      for p, ids in zip(prompt, prompts)]
        return await self._generate(request, prompts, max_tokens, raw, chat=False,
                                    echoed=echoed)

    async def chat(self, request: ChatCompletionRequest, raw: Request):
        self._check_request(request)
        if self.tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer for chat")
        conversation = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                         else [self._content_part(part, f"messages.{i}.content.{j}")
                               for j, part in enumerate(m.content)]}
                        for i, m in enumerate(request.messages)]
        text, media = self._render(conversation)
        ids, mm = await self._process(self._encode(text, "messages"), media, "messages")
        max_tokens = self._max_tokens(request.max_completion_tokens or request.max_tokens, ids,
                                      None)
        return await self._generate(request, [ids], [max_tokens], raw, chat=True,
                                    multimodal=[mm])

    async def transcription(self, raw: Request, file: bytes, model: str,
                            language: str | None, prompt: str | None, response_format: str,
                            temperature: float | None, extra: list[str]):
        """``POST /v1/audio/transcriptions``: the transcript of one WAV clip, greedy unless
        ``temperature`` says otherwise (OpenAI's default is 0), as ``{"text"}`` or plain
        text. A model that takes no audio gets a 400."""
        self._check_model(model)
        for name in extra:
            raise APIError(400, f"{name} is not supported by this server; leave it out",
                           param=name)
        if response_format not in TRANSCRIPTION_FORMATS:
            raise APIError(400, f"response_format must be one of {list(TRANSCRIPTION_FORMATS)}"
                                f", got {response_format!r}", param="response_format")
        processor = self.input_processor
        if processor is None or "audio" not in processor.placeholders or self.tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} takes no audio inputs: it does not "
                                f"transcribe", param="model")
        try:
            messages, continued = processor.transcription_messages(file, language, prompt)
        except MediaError as exc:
            raise APIError(400, f"model {self.model_name!r} cannot transcribe: {exc}",
                           param="model") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="language") from exc
        text, media = self._render(messages, continue_final_message=continued)
        ids, mm = await self._process(self._encode(text, "prompt"), media, "file")
        params = SamplingParams(temperature=temperature or 0.0,
                                max_tokens=self._max_tokens(None, ids, None))
        request_id = f"trsc-{uuid.uuid4().hex}"
        group = await self._add([ids], [params], request_id, [mm])
        try:
            [choice] = await _unless_disconnected(raw, _collect(group, 1))
        finally:
            group.abort()
        transcript = processor.transcript(choice.text)
        if response_format == "text":
            return PlainTextResponse(transcript)
        return TranscriptionResponse(text=transcript)

    def _content_part(self, part, where: str) -> dict:
        """A chat content part as ``render_chat`` takes it. Media must come in the request
        itself: an image as a data URL, audio as base64 (decoded here, so that no string
        can name a file on the server)."""
        if isinstance(part, ImageURLContentPart):
            if not part.image_url.url.startswith("data:"):
                raise APIError(400, f"{where}.image_url.url must be a data URL "
                                    f"(data:image/png;base64,...): remote URLs are not "
                                    f"fetched and files are not read",
                               param=f"{where}.image_url.url")
        elif isinstance(part, InputAudioContentPart):
            try:
                data = base64.b64decode(part.input_audio.data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise APIError(400, f"{where}.input_audio.data is not valid base64 ({exc})",
                               param=f"{where}.input_audio.data") from exc
            return {"type": "input_audio", "input_audio": {
                "data": data, "format": part.input_audio.format}}
        return part.part()

    def _render(self, conversation: list[dict], continue_final_message: bool = False
                ) -> tuple[str, dict]:
        """``render_chat`` (as ``LLM.chat``), its errors as 400s naming the field."""
        try:
            return render_chat(self.tokenizer, conversation, self.input_processor,
                               "messages.{i}.content.{j}", continue_final_message)
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param or "messages") from exc
        except (TemplateError, ValueError) as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from exc

    async def _process(self, ids: list[int], media: dict, param: str):
        """``(token ids, encoder inputs)`` of a prompt with media, decoded and preprocessed
        off the event loop by the front end's own processor; without media the engine
        thread works out the positions. Bad media get a 400 with the engine's message."""
        if not media:
            return ids, None
        try:
            return await asyncio.to_thread(self.engine.engine.process_prompt, ids, media,
                                           self.input_processor)
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param or param) from exc

    # ------------------------------------------------------------------ validation
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server "
                                f"serves {self.model_name!r}", param="model",
                           code="model_not_found")

    def _check_request(self, request) -> None:
        """404 for another model; 400 for the first field sent that is not implemented, or
        for log-probs asked beyond ``MAX_LOGPROBS``."""
        self._check_model(request.model)
        for path in unsupported_fields(request):
            name = path.rsplit(".", 1)[-1]
            neutral = f" (or send {json.dumps(NEUTRAL_VALUES[name])})" \
                if name in NEUTRAL_VALUES else ""
            raise APIError(400, f"{path} is not supported by this server; leave it out"
                                f"{neutral}", param=path)
        name = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        value = getattr(request, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], "
                                f"got {value}", param=name)
        if name == "top_logprobs" and value and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if request.num_logprobs is not None and self.tokenizer is None:
            raise APIError(400, f"model {self.model_name!r} has no tokenizer to name the "
                                f"tokens of log-probs", param=name)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _encode(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of one prompt, checked to fit ``max_model_len`` with room to generate.
        (``tokenize`` and ``validate`` only read the engine's vocabulary size and config.)"""
        try:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(f"model {self.model_name!r} has no tokenizer: "
                                     f"send token ids")
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            else:
                ids = self.engine.engine.tokenize(prompt)
            self.engine.engine.validate(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc
        return ids

    def _max_tokens(self, requested: int | None, prompt: list[int], default: int | None) -> int:
        """``requested`` if it fits after ``prompt``, else a 400; unset: ``default`` (None:
        as many as fit), cut to what is left of ``max_model_len``."""
        room = self.max_model_len - len(prompt)
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(400, f"this model's maximum context length is "
                                f"{self.max_model_len} tokens, but {len(prompt) + requested} "
                                f"were requested ({len(prompt)} in the prompt, {requested} "
                                f"for the completion)", param="max_tokens")
        return requested

    @staticmethod
    def _sampling_params(request, max_tokens: int, choice: int) -> SamplingParams:
        """A 400 for a value out of range names the field (``SamplingParams``' messages
        start with it)."""
        def given(name, default):
            value = getattr(request, name)
            return default if value is None else value

        try:
            return SamplingParams(
                temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
                top_k=given("top_k", -1), max_tokens=max_tokens,
                seed=None if request.seed is None else request.seed + choice,
                ignore_eos=request.ignore_eos, stop=request.stop or [],
                presence_penalty=given("presence_penalty", 0.0),
                frequency_penalty=given("frequency_penalty", 0.0),
                repetition_penalty=given("repetition_penalty", 1.0),
                min_tokens=given("min_tokens", 0), logprobs=request.num_logprobs,
                prompt_logprobs=request.num_logprobs if getattr(request, "echo", False)
                else None)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=name if name in type(request).model_fields
                           else None) from exc

    # ------------------------------------------------------------------ generating
    async def _add(self, prompts: list[list[int]], params: list[SamplingParams],
                   request_id: str, multimodal: list | None = None) -> RequestGroup:
        try:
            return await self.engine.add(prompts, params, request_id, multimodal)
        except EngineStoppedError as exc:
            raise APIError(503, str(exc), type="server_error") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def _generate(self, request, prompts: list[list[int]], max_tokens: list[int],
                        raw: Request, chat: bool, echoed: list[str] | None = None,
                        multimodal: list | None = None):
        """Run ``request.n`` choices per prompt. ``echoed``: the prompts' texts, put before
        each of their choices' texts (completions' ``echo``), with the prompt tokens'
        log-probs when log-probs are asked for. ``multimodal``: per prompt, its encoder
        inputs (``_process``) or None."""
        n = request.num_choices
        params = [self._sampling_params(request, limit, choice)
                  for limit in max_tokens for choice in range(n)]
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        group = await self._add([ids for ids in prompts for _ in range(n)], params, request_id,
                                None if multimodal is None
                                else [mm for mm in multimodal for _ in range(n)])
        prompt_tokens = sum(map(len, prompts))
        if request.stream:
            return StreamingResponse(self._stream(group, request, prompts, echoed,
                                                  prompt_tokens, len(params), chat),
                                     media_type="text/event-stream")
        try:
            choices = await _unless_disconnected(raw, _collect(group, len(params)))
        except GenerationError as exc:
            raise _generation_failed(exc) from exc
        finally:
            group.abort()
        usage = _usage(prompt_tokens, [choice.num_tokens for choice in choices])
        k = request.num_logprobs
        if chat:
            return ChatCompletionResponse(
                id=request_id, model=self.model_name, usage=usage,
                choices=[ChatChoice(index=i, message=AssistantMessage(content=c.text),
                                    finish_reason=c.finish_reason,
                                    logprobs=None if k is None else ChatLogprobs(
                                        content=chat_logprobs(self.token_strings, c.token_ids,
                                                              c.logprobs, k)))
                         for i, c in enumerate(choices)])
        completions = []
        for i, c in enumerate(choices):
            text, token_ids, entries = c.text, c.token_ids, c.logprobs
            if echoed is not None:
                prompt = prompts[i // n]
                text = echoed[i // n] + text
                token_ids = prompt + token_ids
                entries = (c.prompt_logprobs or [None] * len(prompt)) + entries
            logprobs = None if k is None else completion_logprobs(self.token_strings,
                                                                  token_ids, entries)
            completions.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason))
        return CompletionResponse(id=request_id, model=self.model_name, usage=usage,
                                  choices=completions)

    async def _stream(self, group: RequestGroup, request, prompts: list[list[int]],
                      echoed: list[str] | None, prompt_tokens: int, num_choices: int,
                      chat: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice per step with new text, the finish
        reason on its last chunk, usage when asked, then ``[DONE]``. Log-probs go with the
        chunk of their tokens, or the next chunk sent while text is held back; an echoed
        prompt (text and log-probs) opens its choice's first chunk. A client that goes away
        cancels this generator, which aborts the requests."""
        n, k = request.num_choices, request.num_logprobs
        counts = [0] * num_choices
        states = [_StreamedChoice(prefix=echoed[i // n] if echoed is not None else "")
                  for i in range(num_choices)]
        try:
            if chat:  # OpenAI opens each choice with the assistant role
                for index in range(len(counts)):
                    yield _event(self._chat_chunk(group, index, ChatDelta(role="assistant",
                                                                          content="")))
            try:
                async for out in _openai_outputs(group):
                    counts[out.index] = out.num_output_tokens
                    state = states[out.index]
                    if k is not None:
                        if not state.started and echoed is not None:
                            prompt = prompts[out.index // n]
                            state.token_ids += prompt
                            state.logprobs += out.prompt_logprobs or [None] * len(prompt)
                        state.token_ids += out.token_ids
                        state.logprobs += out.logprobs or []
                    state.started = True
                    text = state.prefix + out.text
                    if not text and out.finish_reason is None:
                        continue  # text held back (a stop string may follow)
                    state.prefix = ""
                    if chat:
                        logprobs = None if k is None else ChatLogprobs(content=chat_logprobs(
                            self.token_strings, state.token_ids, state.logprobs, k))
                        yield _event(self._chat_chunk(group, out.index,
                                                      ChatDelta(content=text or None),
                                                      out.finish_reason, logprobs))
                    else:
                        logprobs = None
                        if k is not None:
                            logprobs = completion_logprobs(self.token_strings, state.token_ids,
                                                           state.logprobs, state.offset)
                            state.offset += sum(map(len, logprobs.tokens))
                        yield _event(CompletionResponse(
                            id=group.request_id, model=self.model_name,
                            choices=[CompletionChoice(index=out.index, text=text,
                                                      logprobs=logprobs,
                                                      finish_reason=out.finish_reason)]))
                    state.token_ids, state.logprobs = [], []
                if request.include_usage:
                    chunk_type = ChatCompletionChunk if chat else CompletionResponse
                    yield _event(chunk_type(id=group.request_id, model=self.model_name,
                                            choices=[], usage=_usage(prompt_tokens, counts)))
            except Exception as exc:  # noqa: BLE001 (sent as the stream's last event)
                yield _event(_generation_failed(exc).body)
            yield "data: [DONE]\n\n"
        finally:
            group.abort()

    def _chat_chunk(self, group: RequestGroup, index: int, delta: ChatDelta,
                    finish_reason: str | None = None,
                    logprobs: ChatLogprobs | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=group.request_id, model=self.model_name, choices=[
            ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                            finish_reason=finish_reason)])


@dataclass
class _StreamedChoice:
    """A streamed choice's state: text not yet sent (an echoed prompt), and the tokens and
    log-probs not yet sent."""

    prefix: str = ""
    started: bool = False
    offset: int = 0  # text_offset of the next token (completions)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict | None] = field(default_factory=list)


def _generation_failed(exc: Exception) -> APIError:
    """The 500 of a request whose generation failed (the engine thread logged the cause)."""
    return APIError(500, f"generation failed: {exc}", type="server_error")


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _usage(prompt_tokens: int, completion_counts: list[int]) -> Usage:
    completion_tokens = sum(completion_counts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


async def _openai_outputs(group: RequestGroup) -> AsyncIterator[RequestOutput]:
    """``group``'s outputs with OpenAI's finish reasons."""
    async for out in group:
        yield dataclasses.replace(out, finish_reason=OPENAI_FINISH_REASONS[out.finish_reason])


@dataclass
class _Choice:
    """A whole choice, as collected from its outputs."""

    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # empty unless asked for
    prompt_logprobs: list[dict | None] | None = None


async def _collect(group: RequestGroup, num_choices: int) -> list[_Choice]:
    """Every choice's whole text, finish reason, token count, tokens and log-probs."""
    choices = [_Choice() for _ in range(num_choices)]
    async for out in _openai_outputs(group):
        choice = choices[out.index]
        choice.text += out.text
        choice.finish_reason = out.finish_reason
        choice.num_tokens = out.num_output_tokens
        choice.token_ids += out.token_ids
        choice.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
    return choices


async def _unless_disconnected(raw: Request, work):
    """Await ``work``, cancelling it (499) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
