"""``LLMEngine``: requests in, tokens out, one scheduler step at a time."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import NamedTuple

import torch

from qllm.batch import ScheduledBatch, Sequence
from qllm.cache.registry import CacheRegistry
from qllm.config import EngineConfig, SamplingParams, resolve_device
from qllm.engine.detokenizer import IncrementalDetokenizer
from qllm.engine.scheduler import Scheduler
from qllm.engine.startup import StartupReport
from qllm.model.builder import build_model, load_hf_config
from qllm.model.multimodal import MODALITIES, MediaError, MultimodalInputs, load_audio, load_image
from qllm.plugins.registry import PluginRegistry, default_registry
from qllm.runner import compile_cache
from qllm.runner.model_runner import ModelRunner, SampledStep
from qllm.runner.parallel_autotune import parallel_autotune
from qllm.runner.triton_precompile import compile_ahead_enabled, compile_launches

logger = logging.getLogger(__name__)


class ProcessedPrompt(NamedTuple):
    """A prompt ready to serve (``LLMEngine.process_prompt``): its token ids (media
    placeholders expanded) and, for a multimodal model, its encoder inputs and positions."""

    token_ids: list[int]
    multimodal: MultimodalInputs | None


class LLMEngine:
    """Owns the model runner, the cache registry and the scheduler of one model.

    ``add_request`` validates and queues a request; each ``step`` runs one batch and returns
    the sequences that advanced: the scheduler picks the batch, the runner launches it, and
    the scheduler applies its sampled tokens (``Scheduler.postprocess``). Bad requests raise
    ``ValueError`` before anything is queued, so the engine stays usable.

    With ``async_scheduling`` (the default) a step launches batch N on the device and only
    then waits for the tokens of batch N-1, so the host's work (appending tokens, stop checks,
    scheduling and building batch N+1) overlaps the device's. Batch N takes the tokens of
    N-1 that it needs straight from the device. A sequence that stops on a token of N-1 may
    already be in batch N; that row's token is dropped.
    """

    def __init__(self, config: EngineConfig, plugins: PluginRegistry | None = None):
        self.plugins = plugins or default_registry()
        check_model_dir(config.model)
        # before anything compiles: torch's and Triton's caches are process-wide
        self.startup = StartupReport(compile_cache.configure(config.compile_cache_dir))
        with self.startup.phase("setup"):  # the device's context, the model's config
            self.device = resolve_device(config.device)
            hf_config = load_hf_config(config.model, self.plugins)
        self.hf_config = hf_config
        text_config = hf_config.get_text_config()
        self.vocab_size = text_config.vocab_size
        config.dtype = model_dtype(config.dtype, hf_config, self.device)
        max_positions = text_config.max_position_embeddings
        if config.max_model_len is None:
            config.max_model_len = max_positions
        elif config.max_model_len > max_positions:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_positions}")
        self.config = config
        # on CUDA, an autotuned kernel's configs compile in parallel at start-up (cold caches);
        # Triton's compiles and the tuning runs are counted for the start-up line until then
        # (or a failure)
        with parallel_autotune(enabled=self.device.type == "cuda", log=self.startup.autotunes), \
                self.startup.triton_compiles:
            self._build(config, hf_config)
        logger.info(self.startup.ready())

    def _build(self, config: EngineConfig, hf_config) -> None:
        """Load the model and set up its kernels, cache, runner, scheduler and tokenizer, then
        warm up (on CUDA), each a timed start-up phase."""
        with self.startup.phase("kernels"):
            self.kernels = self.plugins.kernels(self.device, config.dtype, config.kernels)
        # graph capture and warm-up compile their Triton kernels ahead, in threads (CUDA, one
        # process, every op on a plugin's kernel: qllm.runner.triton_precompile)
        self.compile_ahead = (self.device.type == "cuda" and config.tensor_parallel_size == 1
                              and compile_ahead_enabled(self.kernels.names()))
        self.executor = None  # the workers of a tensor-parallel engine (qllm.distributed)
        if config.tensor_parallel_size > 1:  # this process is rank 0; the ranks start here
            from qllm.engine.tensor_parallel.executor import start_engine_shards

            self.executor, self.model, self.cache, self.runner = start_engine_shards(
                self, config, hf_config, self.plugins, self.kernels, self.device)
        else:
            with self.startup.phase("load"):
                self.model = build_model(config, hf_config, self.plugins, self.kernels,
                                         self.device)
            with self.startup.phase("cache"):
                self.cache = CacheRegistry(self.model, self.plugins.layer_kinds,
                                           self.plugins.cache_kinds, config, self.device)
            with self.startup.phase("graph_capture"):  # and the compile set-up
                self.runner = ModelRunner(self.model, config, self.cache, self.device,
                                          self.vocab_size, compile_ahead=self.compile_ahead,
                                          sample_tokens=self.kernels.sample_tokens)
        self.scheduler = Scheduler(config, self.cache)
        with self.startup.phase("tokenizer"):
            self.tokenizer = load_tokenizer(config.model)
            # a multimodal model's media prompts (qllm.model.multimodal); None for text only
            self.input_processor = self.model.input_processor(config.model, self.tokenizer)
        self.eos_token_ids = eos_token_ids(config.model, hf_config.get_text_config(),
                                           self.tokenizer)
        self.sequences: dict[str, Sequence] = {}
        self._in_flight: SampledStep | None = None  # launched, tokens not yet appended
        if config.warm_up and self.device.type == "cuda":
            with self.startup.phase("warm_up"):
                if self.compile_ahead:
                    with compile_launches():  # the warm-up's Triton kernels compile at once,
                        self.warm_up()        # none runs; then the warm-up itself
                self.warm_up()

    def warm_up(self) -> None:
        """Serve dummy prompts that fill one prefill step (``max_num_batched_tokens`` tokens,
        up to ``max_num_seqs`` prompts) and decode, then prefill steps of the sizes
        ``warm_up_prefill_sizes`` lists, then one step of as many one-token prompts as fit,
        then forget their cached prefixes; then one temperature draw (the dummy prompts are
        greedy). Kernels compile and tune here, at start-up, rather
        than inside the first requests of each kind: the full prefill's shapes; the token
        counts that select tile configs and kernels (see ``warm_up_prefill_sizes``); and the
        launch configs that follow the number of sequences in a step (the GDN recurrence's
        tile in short prefill steps)."""
        start = time.perf_counter()
        config = self.config
        count = min(config.max_num_seqs, 16)
        longest = max(1, min(config.max_model_len - 2, config.max_num_batched_tokens))
        length = max(1, min(longest, config.max_num_batched_tokens // count))
        self._serve_dummy([length] * count)
        ladder = warm_up_prefill_sizes(length * count)
        for size in ladder:  # prompts of at most `longest` tokens that sum to `size`
            full, rest = divmod(size, longest)
            self._serve_dummy([longest] * full + ([rest] if rest else []))
        many = min(config.max_num_seqs, config.max_num_batched_tokens)
        self._serve_dummy([1] * many)
        self.runner.warm_up_sampling()
        self.scheduler.num_preemptions = 0
        logger.info("warm-up: %d prompts of %d tokens, then prefill steps of %s tokens, then "
                    "%d one-token prompts, in %.1f s", count, length, ladder, many,
                    time.perf_counter() - start)

    def _serve_dummy(self, lengths: list[int]) -> None:
        """Generate two tokens for dummy prompts of ``lengths`` tokens, all admitted at once,
        with the prefix cache emptied before and after and off between (so no hit or
        state-checkpoint boundary shrinks a prefill step, and no dummy prefix outlives the
        warm-up), and every prefill step run eagerly, never as a prefill CUDA graph (so the
        eager path's kernels meet each step size)."""
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        with self.cache.prefix_caching_paused(), self.runner.eager_prefill():
            for j, length in enumerate(lengths):
                prompt = [(j * length + i) % self.vocab_size for i in range(length)]
                self.add_request(prompt, params, request_id=f"qllm-warm-up-{j}")
            while self.has_unfinished():
                self.step()

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (a string, or token ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model} has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return list(prompt)

    def validate(self, token_ids: list[int]) -> None:
        """Raise ``ValueError`` if a tokenized prompt cannot be served."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.config.max_model_len}: no room to generate")

    def process_prompt(self, prompt: str | list[int], media: dict | None = None,
                       input_processor=None) -> ProcessedPrompt:
        """``prompt`` tokenized and validated (``tokenize``, ``validate``) and, for a
        multimodal model, its encoder inputs and positions. ``media``: modality ("image",
        "audio") -> items in prompt order (see ``qllm.model.multimodal.load_image`` /
        ``load_audio`` for the forms taken); the prompt holds one placeholder
        (``input_processor.placeholders``) per item. Bad media, or a prompt whose media
        tokens do not fit ``max_model_len``, raise ``MediaError``. ``input_processor``:
        another instance of the model's processor to use (the server's front end has its
        own, off the engine thread); with token ids this reads nothing else of the engine
        but its vocabulary size and config."""
        token_ids = self.tokenize(prompt)
        media = {kind: items for kind, items in (media or {}).items() if items}
        processor = input_processor or self.input_processor
        if processor is None:
            if media:
                raise MediaError(f"{self.config.model} is a text-only model; it takes no "
                                 f"{' or '.join(sorted(media))} inputs")
            multimodal = None
        elif not media:
            multimodal = processor.positions(token_ids)
        else:
            token_ids, multimodal = self._expand_media(token_ids, media, processor)
        self.validate(token_ids)
        return ProcessedPrompt(token_ids, multimodal)

    def _expand_media(self, token_ids: list[int], media: dict, processor
                      ) -> tuple[list[int], MultimodalInputs]:
        """``token_ids`` with each media placeholder expanded, and the encoder inputs of
        ``media`` (decoded here)."""
        decoded = {}
        for kind, items in media.items():
            if kind not in MODALITIES:
                raise MediaError(f"unknown media kind {kind!r}; one of {list(MODALITIES)}")
            if kind not in processor.placeholders:
                raise MediaError(f"this model takes "
                                 f"{' and '.join(processor.placeholders)}, not {kind}")
            load = load_image if kind == "image" else load_audio
            decoded[kind] = [load(item) for item in items]
        expanded, mm = processor.process(token_ids, decoded)
        if len(expanded) >= self.config.max_model_len:
            counts = ", ".join(f"{len(items)} {kind}(s)" for kind, items in decoded.items())
            media_tokens = sum(item.length for item in mm.items) if mm else 0
            raise MediaError(f"the prompt has {len(expanded)} tokens ({media_tokens} of them "
                             f"for {counts}), but max_model_len is "
                             f"{self.config.max_model_len}: no room to generate; send fewer "
                             f"or smaller media")
        return expanded, mm

    def add_request(self, prompt: str | list[int] | ProcessedPrompt,
                    sampling_params: SamplingParams, request_id: str | None = None,
                    stream_text: bool = False, media: dict | None = None,
                    multimodal: MultimodalInputs | None = None) -> Sequence:
        """Queue one request; with ``stream_text`` its ``output_text`` grows every step.
        ``prompt`` as for ``process_prompt``, with ``media``; or what ``process_prompt``
        returned (used as it is: the ``n`` choices of one prompt share it); or the expanded
        token ids of a ``process_prompt`` result, with its ``multimodal``."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, "
                            f"got {type(sampling_params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sampling_params, name)
            if asked is not None and asked > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size "
                                 f"({self.vocab_size}), got {asked}")
        if isinstance(prompt, ProcessedPrompt):
            token_ids, multimodal = prompt
        elif multimodal is None:
            token_ids, multimodal = self.process_prompt(prompt, media)
        else:
            token_ids = self.tokenize(prompt)
            self.validate(token_ids)
        if request_id is not None and request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(token_ids, sampling_params, request_id)
        seq.multimodal = multimodal
        if sampling_params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(sampling_params.seed)
        if (stream_text or sampling_params.stop) and self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its cache; unknown or finished ids are ignored."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a token (finished ones included):
        those of this batch, or with ``async_scheduling`` those of the batch before it."""
        launched = self._run(self.scheduler.schedule())
        if self.config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        return self._postprocess(launched)

    def _run(self, batch: ScheduledBatch | None) -> SampledStep | None:
        """Launch ``batch`` on the device (its inputs may take the tokens of the step in
        flight, not yet on the host); its sampled tokens come later."""
        if batch is None:
            return None
        launched = self.runner.launch(batch, previous=self._in_flight,
                                      eos_token_ids=self.eos_token_ids)
        self.scheduler.launched(batch, launched.seqs)
        return launched

    def _postprocess(self, step: SampledStep | None) -> list[Sequence]:
        """Wait for ``step``'s tokens and log-probs, hand them to the scheduler, and retire
        the requests that finished."""
        if step is None:
            return []
        tokens = step.tokens()
        for seq, first, entries in step.prompt_logprobs():
            seq.add_prompt_logprobs(first, entries)
        advanced = self.scheduler.postprocess(step.batch, step.seqs, tokens,
                                              self.eos_token_ids, step.logprobs())
        for seq in advanced:
            if seq.is_finished:
                self._retire(seq)
        return advanced

    def _retire(self, seq: Sequence) -> None:
        """Forget a request that stopped: its id, its encoders' outputs; and give it its
        text when none was made while it ran."""
        self.sequences.pop(seq.request_id, None)
        if seq.multimodal is not None:  # the encoders' outputs are needed no more
            for item in seq.multimodal.items:
                item.embeds = None
        if seq.detokenizer is None and self.tokenizer is not None:
            seq.output_text = self.tokenizer.decode(seq.output_token_ids,
                                                    skip_special_tokens=True)


def warm_up_prefill_sizes(full: int) -> list[int]:
    """Token counts of the warm-up's prefill steps after the first, full one of ``full``
    tokens: 1 and 17, then every power of two from 16 and, between each two from 32, the
    odd size one less than their midpoint (47, 95, ..., ``3 * 2**k - 1``), all below
    ``full``.

    Triton compiles a variant of a kernel per integer argument equal to 1, divisible by 16
    or neither (torch.compile specialises the prefill regions on 1), and the kernels pick
    tiles and paths by token count: the MoE kernels' table (keys from 1 to 16,384 tokens)
    and sort (one program up to 512 tokens), the GDN recurrence up to 512 tokens and fla's
    chunked kernels above (its L2 norm tuned per 4,096 tokens at 16 heads). The odd sizes
    put a count that is not a multiple of 16 into every such range, and reach the ranges
    between powers of two: a step of 2,024 tokens (the tail of chunked prompts) would
    otherwise compile the MoE sort while serving."""
    powers = [1 << k for k in range(4, 32) if 1 << k < full]
    halfway = [(3 << k) - 1 for k in range(4, 32) if (3 << k) - 1 < full]
    return [1, 17] + sorted(powers + halfway)


def check_model_dir(path: str) -> None:
    """Raise unless ``path`` is a local checkpoint directory, saying what it is instead: a
    file (``NotADirectoryError``), or nothing here (``FileNotFoundError``; a Hugging Face repo
    name gets a hint to download it first, as qllm serves only local directories)."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise NotADirectoryError(f"model {path!r} is not a directory; give the checkpoint "
                                 f"directory that holds config.json and the weights")
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith("."):
        hint = (f"; it looks like a Hugging Face repo name, but qllm serves only local "
                f"directories: download it first, e.g. `hf download {path} --local-dir "
                f"{path.split('/')[1]}`")
    raise FileNotFoundError(f"model directory {path!r} does not exist{hint}")


def model_dtype(requested: torch.dtype | str | None, hf_config,
                device: torch.device) -> torch.dtype:
    """The dtype to run in: ``requested`` if a dtype; "auto": the checkpoint's (its
    config.json's ``dtype``, as transformers and vLLM read it) when it records one; None
    (or "auto" without one): fp32 on CPU, on GPU the checkpoint's half precision, else
    bfloat16."""
    if isinstance(requested, torch.dtype):
        return requested
    checkpoint = hf_config.get_text_config().dtype or hf_config.dtype
    if requested == "auto" and isinstance(checkpoint, torch.dtype):
        return checkpoint
    if device.type == "cpu":
        return torch.float32
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when the directory has none."""
    if not any(os.path.exists(os.path.join(model_dir, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: str, text_config, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else the config, else the tokenizer."""
    path = os.path.join(model_dir, "generation_config.json")
    value = None
    if os.path.exists(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    if value is None:
        value = getattr(text_config, "eos_token_id", None)
    if value is None and tokenizer is not None:
        value = tokenizer.eos_token_id
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple)) else {value}
