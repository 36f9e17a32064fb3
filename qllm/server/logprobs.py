"""Log-probs in the OpenAI wire formats: the legacy completions ``logprobs`` object and the
chat ``logprobs.content`` list, from the engine's per-token ``{token_id: Logprob}`` dicts."""

from __future__ import annotations

import functools
import math

from qllm.server.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf: a token the model gives no probability is sent with this (as vLLM does)
MIN_WIRE_LOGPROB = -9999.0


def wire_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_WIRE_LOGPROB


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (used by Qwen's tokenizers): character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenStrings:
    """Token id -> its text (``tokenizer.decode([id])``, as vLLM reports it; a piece of a
    multi-byte character decodes to U+FFFD) and its exact UTF-8 bytes (from the byte-level
    vocabulary where the tokenizer has one, else the text's), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        data = self._bytes.get(token_id)
        if data is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in decoder for c in piece):
                data = [decoder[c] for c in piece]
            else:
                data = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = data
        return data


def completion_logprobs(strings: TokenStrings, token_ids: list[int],
                        entries: list[dict | None], offset: int = 0) -> CompletionLogprobs:
    """The legacy format for ``token_ids`` and their entries (None: an echoed prompt's
    first token); ``top_logprobs`` holds the top tokens and the chosen one, as vLLM's;
    ``text_offset`` counts the token texts from ``offset``."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = strings.text(token)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(wire_logprob(entry[token].logprob))
        top = {}
        for top_id, logprob in entry.items():
            top.setdefault(strings.text(top_id), wire_logprob(logprob.logprob))
        top_logprobs.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                              top_logprobs=top_logprobs, text_offset=text_offset)


def chat_logprobs(strings: TokenStrings, token_ids: list[int], entries: list[dict],
                  num_top: int) -> list[TokenLogprob]:
    """The chat format: per token its text, log-prob and bytes, and the ``num_top`` most
    likely tokens in rank order."""
    content = []
    for token, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:num_top]
        content.append(TokenLogprob(
            token=strings.text(token), logprob=wire_logprob(entry[token].logprob),
            bytes=strings.bytes(token),
            top_logprobs=[TopLogprob(token=strings.text(t), logprob=wire_logprob(lp.logprob),
                                     bytes=strings.bytes(t)) for t, lp in ranked]))
    return content
