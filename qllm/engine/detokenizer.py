"""Incremental detokenization: new text per generated token, without re-decoding everything."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (the tokens since the last emitted boundary) each time, and
    holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD), so the deltas
    concatenate to the full decoded text.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def step(self, token_ids: list[int]) -> str:
        """Append what ``token_ids`` (all output tokens so far) add; return the new text."""
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta
