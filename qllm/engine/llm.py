"""``LLM``: the offline Python API."""

from __future__ import annotations

import dataclasses
import os
import time

from tqdm.auto import tqdm

from qllm.batch import Sequence
from qllm.config import EngineConfig, SamplingParams
from qllm.engine.llm_engine import LLMEngine
from qllm.model.multimodal import flatten_content
from qllm.plugins.registry import PluginRegistry


class LLM:
    """Generate from a Qwen checkpoint directory.

    >>> llm = LLM("path/to/Qwen3-0.6B", dtype="bfloat16")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0]["text"]

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``max_num_seqs``,
    ``max_model_len``, ``gpu_memory_utilization``, ``enforce_eager``, ``load_format``...);
    an unknown one raises ``TypeError``.
    """

    def __init__(self, model: str | os.PathLike, *, plugins: PluginRegistry | None = None,
                 **options):
        model = os.fspath(model) if isinstance(model, os.PathLike) else model
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options), plugins)
        self.last_throughput: dict[str, float] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[dict]:
        """Generate for each prompt (a string or a list of token ids): one prompt or a list.
        A prompt with media is a dict ``{"prompt": text or ids, "multi_modal_data":
        {"image": item or [items], "audio": ...}}``, the prompt holding the model's
        placeholder per item (``llm.engine.input_processor.placeholders``); images are PIL
        images, paths, bytes or base64 / data URLs, audio ``(array, sampling_rate)`` or a WAV
        path, bytes or base64 (``qllm.model.multimodal``). Bad media raise ``MediaError``.

        ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt.
        Returns, in prompt order, one dict per prompt: ``prompt_token_ids``,
        ``prompt_logprobs`` and ``num_cached_tokens`` (prompt tokens served from the prefix
        cache); ``outputs``, its ``n`` completions (``SamplingParams.n``), each a dict with
        ``text``, ``token_ids`` (generated tokens only), ``finish_reason``, ``logprobs`` and
        ``cumulative_logprob``; and the first completion's fields again at the top level.
        ``logprobs``: per generated token ``{token_id: Logprob(logprob, rank)}``, the sampled
        token first, then the ``SamplingParams.logprobs`` most likely ones; ``prompt_logprobs``
        likewise per prompt token, the first None; each None unless asked for. Every prompt
        is validated before any runs: prompts or sampling params of the wrong kind raise
        ``TypeError``, a prompt that cannot be served (not text or token ids, empty, too
        long) or log-probs asked beyond the vocabulary ``ValueError``.
        """
        prompts = _prompt_list(prompts)
        sampling_params = _params_list(sampling_params, len(prompts))
        processed = [self.engine.process_prompt(*_prompt_media(p)) for p in prompts]
        groups: list[list[Sequence]] = []
        try:
            for prompt, params in zip(processed, sampling_params):
                groups.append([])
                for choice in _choices(params):
                    groups[-1].append(self.engine.add_request(prompt, choice))
            self._run([seq for group in groups for seq in group], use_tqdm)
        finally:  # a call interrupted or refused leaves nothing behind
            for seq in (seq for group in groups for seq in group):
                self.engine.abort(seq.request_id)
        return [_result(group) for group in groups]

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> None:
        start = time.perf_counter()
        generated = 0
        with tqdm(total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                advanced = self.engine.step()
                generated += len(advanced)
                finished = sum(seq.is_finished for seq in advanced)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"{generated / max(elapsed, 1e-9):.0f} tok/s")
                bar.update(finished)
        elapsed = time.perf_counter() - start
        self.last_throughput = {"generated_tokens": generated, "seconds": elapsed,
                                "tokens_per_second": generated / max(elapsed, 1e-9)}

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """Generate replies to chat conversations through the tokenizer's chat template: one
        conversation (a list of ``{"role", "content"}`` messages) or a list of them. Roles
        are ``CHAT_ROLES``; "developer" (OpenAI's newer name for it) is sent as "system".
        A message's content may be a list of parts: ``{"type": "text", "text"}``, ``{"type":
        "image", "image": x}`` / ``{"type": "image_url", "image_url": {"url": data URL}}``,
        ``{"type": "audio", "audio": x}`` / ``{"type": "input_audio", "input_audio":
        {"data": base64 WAV, "format": "wav"}}`` (forms as for ``generate``); each media part
        is sent to the template as the model's placeholder text."""
        if self.tokenizer is None:
            raise ValueError(f"{self.engine.config.model} has no tokenizer for chat")
        if isinstance(conversations, list) and conversations \
                and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, list):
            raise TypeError(f"conversations must be a list of messages or a list of "
                            f"conversations, got {type(conversations).__name__}")
        prompts = []
        for conv in conversations:
            text, media = render_chat(self.tokenizer, conv, self.engine.input_processor)
            prompts.append({"prompt": text, "multi_modal_data": media} if media else text)
        return self.generate(prompts, sampling_params, use_tqdm)


def render_chat(tokenizer, conversation, input_processor=None,
                where: str = "messages[{i}].content[{j}]",
                continue_final_message: bool = False) -> tuple[str, dict[str, list]]:
    """``(prompt text, media)`` of a conversation (``LLM.chat``'s and the server's): content
    parts flattened (``qllm.model.multimodal.flatten_content``; each media part becomes the
    placeholder of ``input_processor``, the model's, None for a text-only model), messages
    checked (``chat_messages``) and rendered by the tokenizer's chat template, with the
    assistant's generation prompt or, with ``continue_final_message``, continuing the last
    (assistant) message. ``media``: modality -> items in prompt order, for
    ``LLMEngine.process_prompt``. Raises ``MediaError`` naming the part at fault (``where``
    formats part j of message i), ``ValueError`` for a bad message, and what the template
    raises."""
    placeholders = input_processor.placeholders if input_processor is not None else {}
    messages, media = flatten_content(conversation, placeholders, where)
    text = tokenizer.apply_chat_template(chat_messages(messages), tokenize=False,
                                         add_generation_prompt=not continue_final_message,
                                         continue_final_message=continue_final_message)
    return text, media


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(conversation) -> list[dict]:
    """``conversation`` checked and ready for a chat template: a non-empty list of message
    dicts, each with a ``role`` of ``CHAT_ROLES`` ("developer" becomes "system", the role
    Qwen's templates render) and a string ``content``. Other keys pass through to the
    template. Raises ``ValueError`` naming the message and the field at fault: a template
    silently drops what it does not know."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"a conversation must be a non-empty list of messages, "
                         f"got {conversation!r}")
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {message!r}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, "
                             f"got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {content!r}")
        messages.append({**message, "role": "system" if role == "developer" else role})
    return messages


def _prompt_list(prompts) -> list:
    """``prompts`` as a list: one prompt (a string or a list of token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a dict with 'prompt' and "
                    f"'multi_modal_data', or a list of those, got {type(prompts).__name__}")


def _prompt_media(prompt) -> tuple:
    """``(prompt, media)`` of a prompt: a string or token ids (no media), or a dict
    ``{"prompt": ..., "multi_modal_data": {modality: item or [items]}}``."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
    if unknown or "prompt" not in prompt:
        raise TypeError(f"a prompt dict takes 'prompt' and 'multi_modal_data', got keys "
                        f"{sorted(prompt)}")
    media = prompt.get("multi_modal_data") or {}
    if not isinstance(media, dict):
        raise ValueError(f"multi_modal_data must be a dict of modality -> items, "
                         f"got {type(media).__name__}")
    return prompt["prompt"], {kind: items if isinstance(items, list) else [items]
                              for kind, items in media.items()}


def _params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt, from None (the defaults), one for all, or a list."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params):
        hint = " (build one with SamplingParams(**params))" \
            if isinstance(sampling_params, dict) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per "
                        f"prompt, got {type(sampling_params).__name__}{hint}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling params for "
                         f"{num_prompts} prompts")
    return list(sampling_params)


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """The ``n`` engine requests of one prompt: choice i samples with ``seed + i`` (as the
    server's choices do); only the first computes the prompt's log-probs."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1,
                                seed=None if params.seed is None else params.seed + i,
                                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(params.n)]


def _result(group: list[Sequence]) -> dict:
    """One prompt's result: its completions under ``outputs``, the first one's fields also
    at the top level."""
    outputs = [{"text": seq.output_text, "token_ids": seq.output_token_ids,
                "finish_reason": seq.finish_reason, "logprobs": seq.logprobs,
                "cumulative_logprob": seq.cumulative_logprob} for seq in group]
    first = group[0]
    return {**outputs[0], "prompt_token_ids": first.token_ids[:first.num_prompt_tokens],
            "prompt_logprobs": first.prompt_logprobs,
            "num_cached_tokens": first.num_cached_tokens, "outputs": outputs}
