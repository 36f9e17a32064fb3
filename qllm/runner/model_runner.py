"""Runs one scheduled step: builds its ``ForwardBatch``, runs the model, samples tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.fx.experimental._config

from qllm.batch import ForwardBatch, ScheduledBatch, Sequence
from qllm.cache.registry import CacheRegistry
from qllm.config import EngineConfig
from qllm.layers.logprobs import prompt_token_logprobs, token_logprobs, tokens_only, unpack
from qllm.layers.penalties import LogitsAdjustments, apply_penalties
from qllm.layers.sampler import SamplingTensors, sample
from qllm.model.causal_lm import CausalLM
from qllm.model.multimodal import encoder_rows, rotary_positions
from qllm.ops.sampling import sample_tokens as reference_sample_tokens
from qllm.runner.cuda_graphs import CudaGraphCapture, GraphShape, HostSyncError, StepGraphs
from qllm.runner.staging import stage
from qllm.runner.triton_precompile import compile_launches

logger = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64


@dataclasses.dataclass
class SampledStep:
    """A launched step's sampled tokens: on the device at once (the next step can take its
    inputs from them), on the host once ``tokens()`` has waited for the copy. Log-probs, when
    some sequence of the step asked for them, come in the same copy: ``host_tokens`` then
    holds packed rows (``qllm.layers.logprobs``), the sampled tokens' and then those of the
    prompt tokens of ``prompt_spans``."""

    batch: ScheduledBatch
    seqs: list[Sequence]          # the sequences that sampled, in token order
    device_tokens: torch.Tensor   # [N] int64
    # [N] int64, or [N + M, 3 + 2K] packed with log-probs; pinned on CUDA, filled
    # asynchronously
    host_tokens: torch.Tensor
    copied: torch.cuda.Event | None
    num_logprobs: int | None = None  # K of the packed rows; None: tokens only
    # (sequence, first prompt position, count): the M prompt rows, in order; position j
    # scores prompt token j + 1
    prompt_spans: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)
    rows: dict[int, int] = dataclasses.field(init=False)  # seq_id -> row of device_tokens

    def __post_init__(self):
        self.rows = {seq.seq_id: row for row, seq in enumerate(self.seqs)}

    def tokens(self) -> list[int]:
        """The sampled tokens as Python ints (waits for the step: the one host sync)."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.num_logprobs is None:
            return self.host_tokens.tolist()
        return self.host_tokens[:len(self.seqs), 0].tolist()

    def logprobs(self) -> list[dict | None]:
        """Per sampled sequence, ``{token: Logprob}`` of its token and its top
        ``logprobs``, or None where it did not ask (call after ``tokens``)."""
        if self.num_logprobs is None:
            return [None] * len(self.seqs)
        return unpack(self.host_tokens[:len(self.seqs)], self.num_logprobs,
                      [seq.sampling_params.logprobs for seq in self.seqs])

    def prompt_logprobs(self) -> list[tuple[Sequence, int, list[dict]]]:
        """``(seq, first position, entries)`` per prompt span (call after ``tokens``)."""
        out, start = [], len(self.seqs)
        for seq, first, count in self.prompt_spans:
            wanted = [seq.sampling_params.prompt_logprobs] * count
            out.append((seq, first, unpack(self.host_tokens[start:start + count],
                                           self.num_logprobs, wanted)))
            start += count
        return out


@dataclasses.dataclass
class HostInputs:
    """One step's inputs on the host (``ModelRunner.host_inputs``), as ``stage`` takes them:
    ``fields`` name -> (values, dtype), the cache kinds' fields named ``"{kind}.{field}"``
    (``cache_fields`` lists each kind's); host copies of the query and sequence lengths;
    ``num_sampled`` rows whose next token is sampled (before any padding); the media rows'
    encoder outputs (prefill with media only); the captured shape the step is padded to, if
    any. Picklable."""

    is_prefill: bool
    fields: dict[str, tuple[list, torch.dtype]]
    cache_fields: dict[str, list[str]]
    query_lens: list[int]
    seq_lens: list[int]
    num_sampled: int
    encoder_embeds: torch.Tensor | None = None
    graph: GraphShape | None = None


class ModelRunner:
    """Owns the model and turns scheduled batches into sampled tokens.

    Decode runs through ``torch.compile``d decoder layers and, on CUDA, CUDA graphs of whole
    steps, one per padded batch-size bucket, captured at start-up; a decode batch larger than
    the largest bucket runs without graphs. Prefill runs the decoder layers eagerly around
    their compiled pointwise regions (``CausalLM.prefill_regions``), except that a step of
    one sequence whose prompt it completes, in at most the largest of
    ``prefill_cudagraph_token_sizes`` tokens, replays a CUDA graph of its token-count bucket
    (no prompt log-probs, no media). ``enforce_eager`` turns all of it off; on CPU it is off
    unless ``compile_on_cpu``.
    """

    def __init__(self, model: CausalLM, config: EngineConfig, cache: CacheRegistry,
                 device: torch.device, vocab_size: int, compile_ahead: bool = False,
                 sample_tokens=reference_sample_tokens):
        self.model = model
        self.compile_ahead = compile_ahead  # compile_graph_kernels before the capture
        self.sample_tokens = sample_tokens  # the sample_tokens op's kernel (qllm.ops.sampling)
        self.config = config
        self.cache = cache
        self.device = device
        self.vocab_size = vocab_size
        # the cache kinds' pools, in the registry's (the model's) order: each builds its own
        # fields of every step, padding rows included
        self.pools = list(cache.pools.items())
        # a multi-axis rotary model (M-RoPE) takes positions [A, T] (qllm.model.multimodal)
        self.position_axes = getattr(model, "rotary_position_axes", 1)
        self.graphs: StepGraphs | None = None  # decode
        self.prefill_graphs: StepGraphs | None = None
        use_compile = not config.enforce_eager and (device.type == "cuda" or config.compile_on_cpu)
        if use_compile:
            self._compile()

    # ----------------------------------------------------------------- batch metadata
    def prepare(self, scheduled: ScheduledBatch, graph: GraphShape | None = None,
                fixed_layout: bool = False, previous: SampledStep | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """Inputs ``[T]``, positions ``[T]`` (``[A, T]`` for a model of ``A > 1`` rotary
        position axes) and the ``ForwardBatch`` of a step, padded with inert rows up to the
        captured shape ``graph`` (see ``GraphShape``), all views of one staged buffer
        (``batch.staged``, see ``staging``). Each cache kind's pool adds its own fields
        (``CachePool.step_fields``), for ``fixed_layout`` in the fixed shapes that a CUDA
        graph's static inputs take (sized for ``max_model_len``). A pending input token
        (sampled by the ``previous`` step, not yet on the host) is taken from that step's
        device tokens. A prefill step's rows of media placeholders get their encoder's output
        (``batch.encoder_rows`` / ``encoder_embeds``; the encoder runs on an item's first
        step)."""
        inputs = self.host_inputs(scheduled, graph, fixed_layout, previous)
        return self.stage_inputs(inputs, None if previous is None else previous.device_tokens)

    def host_inputs(self, scheduled: ScheduledBatch, graph: GraphShape | None = None,
                    fixed_layout: bool = False, previous: SampledStep | None = None
                    ) -> HostInputs:
        """The host half of ``prepare``: the step's fields as lists, before staging (what a
        tensor-parallel driver sends its workers)."""
        input_ids, positions = [], []
        axes_positions = [[] for _ in range(self.position_axes)]
        mm_rows, mm_embeds = [], []
        query_start_loc, seq_lens, context_lens, logits_indices = [0], [], [], []
        pending_rows, pending_sources = [], []
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            known = seq.token_ids[start:end]
            if len(known) < n:  # the last input is pending: only ever one, in a decode step
                assert previous is not None and n - len(known) == 1, f"{seq}: inputs missing"
                pending_rows.append(len(input_ids) + len(known))
                pending_sources.append(previous.rows[seq.seq_id])
                known.append(0)
            if seq.multimodal is not None and scheduled.is_prefill:
                for item, first, last in encoder_rows(seq.multimodal, start, end):
                    row = len(input_ids) + item.offset + first - start
                    mm_rows += range(row, row + last - first)
                    mm_embeds.append(self._encoded(item)[first:last])
            input_ids += known
            if self.position_axes > 1:
                for axis, rows in zip(axes_positions, rotary_positions(
                        seq.multimodal, start, end, self.position_axes)):
                    axis += rows
            else:
                positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            context_lens.append(start)
            if end == len(seq):
                logits_indices.append(query_start_loc[-1] - 1)
        num_padding, padding_len = (0, 1) if graph is None else \
            graph.padding(len(scheduled), query_start_loc[-1])
        max_model_len = self.config.max_model_len if fixed_layout else None
        cache_fields = {name: pool.step_fields(scheduled.seqs, context_lens, seq_lens,
                                               num_padding, max_model_len, padding_len,
                                               scheduled.is_prefill)
                        for name, pool in self.pools}
        if num_padding:  # inert rows of a CUDA-graph bucket, each sampling its last token
            padding_positions = list(range(padding_len)) * num_padding
            input_ids += [0] * len(padding_positions)
            positions += padding_positions
            for axis in axes_positions:
                axis += padding_positions
            first = query_start_loc[-1]
            ends = [first + padding_len * (row + 1) for row in range(num_padding)]
            query_start_loc += ends
            # new lists: the pools were handed these
            seq_lens = seq_lens + [padding_len] * num_padding
            context_lens = context_lens + [0] * num_padding
            logits_indices += [end - 1 for end in ends]
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        if self.position_axes > 1:
            positions = axes_positions
        fields = {"input_ids": (input_ids, torch.int64), "positions": (positions, torch.int64),
                  "query_start_loc": (query_start_loc, torch.int32),
                  "seq_lens": (seq_lens, torch.int32),
                  "context_lens": (context_lens, torch.int32),
                  "logits_indices": (logits_indices, torch.int64)}
        for name, kind_fields in cache_fields.items():  # "paged_kv.block_tables", ...
            for field, value in kind_fields.items():
                fields[f"{name}.{field}"] = value
        if pending_rows:  # last: a decode graph's static buffer ends before them
            fields["pending_rows"] = (pending_rows, torch.int64)
            fields["pending_sources"] = (pending_sources, torch.int64)
        if mm_rows:  # prefill only
            fields["encoder_rows"] = (mm_rows, torch.int64)
        return HostInputs(scheduled.is_prefill, fields,
                          {name: list(kind_fields) for name, kind_fields in cache_fields.items()},
                          query_lens, seq_lens, len(logits_indices) - num_padding,
                          torch.cat(mm_embeds) if mm_rows else None, graph)

    def stage_inputs(self, inputs: HostInputs, pending_tokens: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """The device half of ``prepare``: stage ``inputs`` in one copy and build the
        ``ForwardBatch``; pending input tokens come from ``pending_tokens`` (the device tokens
        of the step before)."""
        # a field of dtype None is a host object (CachePool.step_fields), not staged
        staged, tensors, layout = stage({name: field for name, field in inputs.fields.items()
                                         if field[1] is not None}, self.device)
        tensors.update({name: value for name, (value, dtype) in inputs.fields.items()
                        if dtype is None})
        caches = {name: pool.batch_type(**{field: tensors[f"{name}.{field}"]
                                           for field in inputs.cache_fields[name]})
                  for name, pool in self.pools}
        prefill = inputs.is_prefill
        embeds = inputs.encoder_embeds
        max_query_len, max_seq_len = max(inputs.query_lens), max(inputs.seq_lens)
        if prefill and inputs.graph is not None:  # the graph's launches hold for any step
            max_query_len, max_seq_len = inputs.graph.size, self.config.max_model_len
        batch = ForwardBatch(
            is_prefill=prefill,
            query_start_loc=tensors["query_start_loc"],
            seq_lens=tensors["seq_lens"],
            context_lens=tensors["context_lens"],
            logits_indices=tensors["logits_indices"],
            caches=caches,
            query_lens_host=inputs.query_lens if prefill else None,
            seq_lens_host=inputs.seq_lens if prefill else None,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            staged=staged,
            staged_layout=layout,
            encoder_rows=tensors.get("encoder_rows"),
            encoder_embeds=None if embeds is None else embeds.to(self.device),
        )
        input_ids = tensors["input_ids"]
        if "pending_rows" in tensors:
            input_ids[tensors["pending_rows"]] = pending_tokens[tensors["pending_sources"]]
        return input_ids, tensors["positions"], batch

    def _encoded(self, item) -> torch.Tensor:
        """A media item's encoder output ``[item.length, H]``, computed on its first step
        and kept with the request (a chunked or recomputed prompt reuses it)."""
        if item.embeds is None:
            embeds = self.model.encode(item)
            if embeds.shape[0] != item.length:
                raise RuntimeError(f"the {item.modality} encoder gave {embeds.shape[0]} rows "
                                   f"for {item.length} placeholder tokens")
            item.embeds = embeds
        return item.embeds

    # ----------------------------------------------------------------- forward
    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(input_ids, positions, batch)  # [T, H]
        return self.model.compute_logits(hidden[batch.logits_indices])  # [N, V]

    def decode_logits(self, input_ids, positions, batch) -> torch.Tensor:
        """A decode step's logits ``[B, V]``: the forward that a decode CUDA graph captures
        (``benchmarks/decode_modes.py`` compiles it whole, against these graphs)."""
        hidden = self.model(input_ids, positions, batch)  # [B, H]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def step_logits(self, scheduled: ScheduledBatch,
                    previous: SampledStep | None = None,
                    prompt_logprobs: tuple[list[int], list[int], int] | None = None):
        """Queue the forward pass of one step: logits ``[N, V]`` of the sequences whose every
        position is then computed. A step that fits a captured CUDA graph replays it
        (``graph_shape``); others run the layers as they are (see the class docstring).

        With ``prompt_logprobs`` = (rows of the step's tokens, the prompt tokens they
        predict, K) (prefill only), returns ``(logits, packed)``: also the packed log-probs
        of those prompt tokens (``qllm.layers.logprobs``)."""
        graph = None if prompt_logprobs is not None else self.graph_shape(scheduled)
        if graph is not None:
            input_ids, positions, batch = self._step_inputs(scheduled, previous, graph)
            return self.replay(graph, input_ids, positions, batch)[:len(scheduled)]
        input_ids, positions, batch = self._step_inputs(scheduled, previous)
        if prompt_logprobs is None:
            return self._forward_logits(input_ids, positions, batch)
        rows, targets, k = prompt_logprobs
        hidden = self.model(input_ids, positions, batch)  # [T, H]
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        staged = torch.tensor([rows, targets], dtype=torch.int64,
                              pin_memory=self.device.type == "cuda").to(self.device,
                                                                        non_blocking=True)
        return logits, prompt_token_logprobs(self.model.compute_logits, hidden, staged[0],
                                             staged[1], k)

    def graph_shape(self, scheduled: ScheduledBatch) -> GraphShape | None:
        """The captured shape that ``scheduled`` runs in, or None to run the layers as they
        are: a decode batch of at most the largest decode bucket; a prefill step of one
        sequence, without media or a pending input token, whose prompt it completes in at
        most the largest prefill bucket's tokens, and that no cache kind needs eager
        (``CacheRegistry.needs_eager``: a state checkpoint saved on the way)."""
        if not scheduled.is_prefill:
            size = self.graphs.bucket(len(scheduled)) if self.graphs is not None else None
            return None if size is None else GraphShape(False, size)
        if self.prefill_graphs is None or len(scheduled) != 1:
            return None
        seq, num_tokens = scheduled.seqs[0], scheduled.num_tokens[0]
        if seq.multimodal is not None or seq.num_pending_tokens \
                or seq.num_computed_tokens + num_tokens != len(seq) \
                or self.cache.needs_eager(seq, num_tokens):
            return None  # media rows, a pending input, a chunk that samples nothing, saves
        size = self.prefill_graphs.bucket(num_tokens)
        return None if size is None else GraphShape(True, size)

    @contextlib.contextmanager
    def eager_prefill(self):
        """Within: prefill steps run the layers as they are, never a prefill graph (the
        start-up warm-up compiles the eager path's kernels for its step sizes)."""
        graphs, self.prefill_graphs = self.prefill_graphs, None
        try:
            yield
        finally:
            self.prefill_graphs = graphs

    def replay(self, graph: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
               batch: ForwardBatch) -> torch.Tensor:
        """Replay the captured step of shape ``graph`` on inputs staged in its fixed layout;
        returns its static logits (one row per sequence, inert rows included)."""
        graphs = self.prefill_graphs if graph.is_prefill else self.graphs
        return graphs.replay(input_ids, positions, batch)

    def _step_inputs(self, scheduled: ScheduledBatch, previous: SampledStep | None,
                     graph: GraphShape | None = None):
        """A step's inputs for ``step_logits``, padded to the captured shape ``graph`` if one
        (a tensor-parallel driver also sends them to its workers here)."""
        return self.prepare(scheduled, graph, fixed_layout=graph is not None,
                            previous=previous)

    def _prompt_logprob_rows(self, scheduled: ScheduledBatch):
        """The prompt positions of a prefill step whose log-probs are asked for and not yet
        collected: ``(spans, rows, targets)`` as for ``SampledStep.prompt_spans`` and
        ``step_logits``."""
        spans, rows, targets = [], [], []
        offset = 0
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            computed = seq.num_computed_tokens
            if scheduled.is_prefill and seq.prompt_logprobs is not None:
                start = max(computed, len(seq.prompt_logprobs) - 1)
                end = min(computed + n, seq.num_prompt_tokens - 1)
                if start < end:
                    spans.append((seq, start, end - start))
                    rows += range(offset + start - computed, offset + end - computed)
                    targets += seq.token_ids[start + 1:end + 1]
            offset += n
        return spans, rows, targets

    def _adjustments(self, seqs: list[Sequence], previous: SampledStep | None,
                     eos_token_ids: set[int]) -> LogitsAdjustments | None:
        """Penalties and ``min_tokens`` bans of a step's sampled sequences; None when no row
        uses them. A generated token still pending comes from ``previous``'s device
        tokens."""
        params = [seq.sampling_params for seq in seqs]
        if not any(p.uses_penalties or p.min_tokens for p in params):
            return None
        prompts, outputs, num_outputs, pending_rows, sources = [], [], [], [], []
        for row, (seq, p) in enumerate(zip(seqs, params)):
            num_outputs.append(len(seq) - seq.num_prompt_tokens)
            outputs.append(seq.output_token_ids if p.uses_penalties else [])
            prompts.append(seq.token_ids[:seq.num_prompt_tokens]
                           if p.repetition_penalty != 1 else [])
            if p.uses_penalties and seq.num_pending_tokens:
                assert seq.num_pending_tokens == 1 and previous is not None, seq
                pending_rows.append(row)
                sources.append(previous.rows[seq.seq_id])
        pending = None
        if pending_rows:
            index = torch.tensor(sources, dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda").to(self.device,
                                                                           non_blocking=True)
            pending = (pending_rows, previous.device_tokens[index])
        return LogitsAdjustments.build(params, prompts, outputs, pending, num_outputs,
                                       eos_token_ids, self.vocab_size, self.device)

    @torch.inference_mode()
    def launch(self, scheduled: ScheduledBatch, previous: SampledStep | None = None,
               eos_token_ids: set[int] = frozenset()) -> SampledStep:
        """Queue one step on the device and return its sampled tokens without waiting for
        them. ``previous`` is the step launched before, whose tokens may still be pending.
        Tokens are sampled for the sequences whose every position is then computed (all of a
        decode step; in prefill, those whose prompt is now fully computed). Penalties and
        ``min_tokens`` (banning ``eos_token_ids``) apply where asked; log-probs, of the raw
        logits, are computed where asked and come to the host with the tokens."""
        sampled_seqs = [seq for seq, n in zip(scheduled.seqs, scheduled.num_tokens)
                        if seq.num_computed_tokens + n == len(seq)]
        wanted = [seq.sampling_params.logprobs for seq in sampled_seqs
                  if seq.sampling_params.logprobs is not None]
        spans, rows, targets = self._prompt_logprob_rows(scheduled)
        width = max(wanted + [seq.sampling_params.prompt_logprobs for seq, _, _ in spans],
                    default=None)
        prompt_packed = None
        if spans:
            logits, prompt_packed = self.step_logits(scheduled, previous,
                                                     (rows, targets, width))
        else:
            logits = self.step_logits(scheduled, previous)
        if sampled_seqs:
            settings = SamplingTensors.build([seq.sampling_params for seq in sampled_seqs],
                                             [seq.generator for seq in sampled_seqs],
                                             self.vocab_size, self.device)
            adjust = self._adjustments(sampled_seqs, previous, eos_token_ids)
            device_tokens = sample(logits if adjust is None else apply_penalties(logits, adjust),
                                   settings, self.sample_tokens)  # [N]
        else:
            device_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        out = device_tokens
        if width is not None:  # [N + M, 3 + 2 * width]
            out = token_logprobs(logits, device_tokens, width) if wanted \
                else tokens_only(device_tokens, width)
            if prompt_packed is not None:
                out = torch.cat([out, prompt_packed])
        if self.device.type != "cuda":
            return SampledStep(scheduled, sampled_seqs, device_tokens, out, None, width, spans)
        host_tokens = torch.empty(out.shape, dtype=torch.int64, pin_memory=True)
        host_tokens.copy_(out, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledStep(scheduled, sampled_seqs, device_tokens, host_tokens, copied, width,
                           spans)

    def warm_up_sampling(self) -> None:
        """One temperature draw through ``sample_tokens`` from dummy logits in the model's
        dtype, so that its kernels compile at start-up, not in the first sampled request."""
        logits = torch.zeros(1, self.vocab_size, dtype=self.config.dtype, device=self.device)
        self.sample_tokens(logits, torch.ones(1, device=self.device), 0)

    # ----------------------------------------------------------------- compiled decode
    def _compile(self) -> None:
        """Compile each decoder layer (one compiled graph shared by all layers of a kind,
        symbolic batch size) and each prefill region (symbolic token count), then capture
        whole decode steps as CUDA graphs per bucket.

        Regional compilation keeps start-up short: the compiler sees one layer. Against the
        whole model compiled as one ``reduce-overhead`` graph (``benchmarks/decode_modes.py``,
        W3 on the H200) this path's decode step was 4% faster and its start-up 13 s against
        65 s on a warm compile cache (README, "How a step runs").
        """
        start = time.perf_counter()
        # Layer variants (attention kind, first layer, dense or MoE MLP, batch 1) each add a
        # guarded entry to the one shared code object; dynamo's default limit of 8 is too few.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   RECOMPILE_LIMIT)
        # No duck sizing: with it, two sizes that happen to be equal at trace time share one
        # symbol (e.g. the KV cache's block count and a staged field's offset), so what a
        # compiled graph is, and its compile-cache key, changes with the launch's block
        # count, which follows the free memory; each size keeps its own symbol instead.
        torch.fx.experimental._config.use_duck_shape = False
        options = {"max_autotune_gemm": True} if self.config.max_autotune_gemm else None
        for layer in self.model.decoder_layers():
            layer.compile(dynamic=True, fullgraph=True, options=options)
        for region in self.model.prefill_regions():  # inlined into the layers' decode graphs
            region.compile(dynamic=True, fullgraph=True)
        if self.device.type == "cuda":
            capture = CudaGraphCapture(self.device)
            with torch.inference_mode():
                if self.compile_ahead:
                    self.compile_graph_kernels()
                self.graphs = self.capture_graphs(False, self.decode_graph_sizes(), capture)
                try:
                    self.prefill_graphs = self.capture_graphs(
                        True, self.prefill_graph_sizes(), capture)
                except HostSyncError as exc:  # e.g. a plain-torch reference kernel
                    logger.warning("prefill runs eagerly, without CUDA graphs: a prefill "
                                   "kernel reads device values on the host (%s)", exc)
            torch.cuda.synchronize(self.device)
        self.startup_compile_seconds = time.perf_counter() - start
        logger.info("decode compiled%s%s in %.1f s",
                    f" and captured for batch sizes {self.graphs.sizes}" if self.graphs else "",
                    f", prefill captured for {self.prefill_graphs.sizes} tokens"
                    if self.prefill_graphs else "", self.startup_compile_seconds)

    def decode_graph_sizes(self) -> list[int]:
        """The decode buckets: ``cudagraph_batch_sizes`` up to ``max_num_seqs``, and that."""
        config = self.config
        sizes = [s for s in config.cudagraph_batch_sizes if s <= config.max_num_seqs]
        if not sizes or sizes[-1] < config.max_num_seqs:
            sizes.append(config.max_num_seqs)
        return sizes

    def prefill_graph_sizes(self) -> list[int]:
        """The prefill buckets: ``prefill_cudagraph_token_sizes`` that one step and one
        sequence can hold."""
        config = self.config
        limit = min(config.max_num_batched_tokens, config.max_model_len)
        return [s for s in config.prefill_cudagraph_token_sizes if s <= limit]

    def capture_graphs(self, is_prefill: bool, sizes: list[int], capture) -> StepGraphs | None:
        """Graphs of whole steps of one phase for each bucket of ``sizes`` (None if none),
        each recorded by ``capture(fn) -> (graph, output)`` on inert inputs of its fixed
        shape (``GraphShape``)."""
        if not sizes:
            return None
        step, make_inputs = self._graph_step(is_prefill)
        return StepGraphs(step, make_inputs, sizes, capture, "prefill" if is_prefill else "decode")

    def compile_graph_kernels(self) -> None:
        """Run every decode and prefill graph bucket's step once on its inert inputs with the
        Triton kernels' launches compiling them, all in threads, rather than running them
        (``qllm.runner.triton_precompile``): the capture that follows finds them compiled."""
        with compile_launches():
            for is_prefill, sizes in ((False, self.decode_graph_sizes()),
                                      (True, self.prefill_graph_sizes())):
                step, make_inputs = self._graph_step(is_prefill)
                for size in sizes:
                    step(*make_inputs(size))

    def _graph_step(self, is_prefill: bool):
        """``(step, make_inputs)`` of one phase's graphs: the step, and the inert inputs of a
        bucket's fixed shape (``GraphShape``) staged as a graph's."""
        dummy = ScheduledBatch([], [], is_prefill=is_prefill)
        step = self._forward_logits if is_prefill else self.decode_logits
        return step, lambda size: self.prepare(dummy, GraphShape(is_prefill, size),
                                               fixed_layout=True)
