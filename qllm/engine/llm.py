"""``LLM``: the offline Python API."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from qllm.config import EngineConfig, SamplingParams
from qllm.engine.llm_engine import LLMEngine
from qllm.engine.sequence import Sequence
from qllm.plugins import PluginRegistry


class LLM:
    """Generate from a Qwen checkpoint directory.

    >>> llm = LLM("path/to/Qwen3-0.6B", dtype="bfloat16")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0]["text"]

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``, ``max_num_seqs``,
    ``max_model_len``, ``gpu_memory_utilization``, ``enforce_eager``, ``load_format``...);
    an unknown one raises ``TypeError``.
    """

    def __init__(self, model: str, *, plugins: PluginRegistry | None = None, **options):
        self.engine = LLMEngine(EngineConfig.from_kwargs(str(model), **options), plugins)
        self.last_throughput: dict[str, float] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[dict]:
        """Generate for each prompt (a string or a list of token ids).

        ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt.
        Returns, in prompt order, dicts with ``text``, ``token_ids`` (generated tokens only),
        ``prompt_token_ids``, ``finish_reason`` and ``num_cached_tokens`` (prompt tokens
        served from the prefix cache). Every prompt is validated before any runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for "
                             f"{len(prompts)} prompts")
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for ids in token_ids:
            self.engine.validate(ids)
        seqs = [self.engine.add_request(ids, params)
                for ids, params in zip(token_ids, sampling_params)]
        try:
            self._run(seqs, use_tqdm)
        finally:
            for seq in seqs:  # an interrupted call leaves nothing behind
                self.engine.abort(seq.request_id)
        return [_result(seq) for seq in seqs]

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
        """Generate replies to chat conversations (lists of ``{"role", "content"}``) through
        the tokenizer's chat template. One conversation or a list of them."""
        if self.tokenizer is None:
            raise ValueError(f"{self.engine.config.model} has no tokenizer for chat")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(conv, tokenize=False,
                                                      add_generation_prompt=True)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def _result(seq: Sequence) -> dict:
    return {"text": seq.output_text, "token_ids": seq.output_token_ids,
            "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
            "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}
