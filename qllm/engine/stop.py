"""Stop conditions checked after every sampled token."""

from __future__ import annotations

from qllm.batch import Sequence


def check_stop(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> str | None:
    """The finish reason ("stop" or "length") if ``seq`` must stop now, else None.

    Stop strings are checked against ``seq.output_text``; on a match the text is cut before the
    stop string (as OpenAI does) and the sequence stops. Before ``min_tokens`` tokens are
    generated only the length limits apply (the sampler bans EOS and stop token ids then).
    """
    params = seq.sampling_params
    token = seq.token_ids[-1]
    if seq.num_output_tokens < params.min_tokens:
        return "length" if reaches_length_limit(seq, max_model_len) else None
    if not params.ignore_eos and token in eos_token_ids:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.stop:
        # Only the tail can hold a new match: the text before it was checked already.
        search_from = max(0, len(seq.output_text) - seq.last_text_delta_len
                          - max(len(s) for s in params.stop))
        hits = [i for i in (seq.output_text.find(s, search_from) for s in params.stop) if i >= 0]
        if hits:
            seq.output_text = seq.output_text[:min(hits)]
            return "stop"
    if reaches_length_limit(seq, max_model_len):
        return "length"
    return None


def reaches_length_limit(seq: Sequence, max_model_len: int, num_pending: int = 0) -> bool:
    """Whether ``seq`` is at its ``max_tokens`` or at ``max_model_len`` once ``num_pending``
    more tokens are appended."""
    return (seq.num_output_tokens + num_pending >= seq.sampling_params.max_tokens
            or len(seq.token_ids) + num_pending >= max_model_len)
