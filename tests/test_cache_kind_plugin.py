"""A cache kind from outside the core is served like the built-in ones: a test-local plugin
registers the ``probe_pages`` cache kind, the ``token_probe`` layer kind and a Qwen3 whose
model holds one ``TokenProbe`` layer. Its pool builds its own batch fields (padded with its
own padding page in CUDA-graph buckets) and runs its own size check."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from qllm import LLM, SamplingParams
from qllm.batch import Sequence
from qllm.cache.base import CachePool, CacheRequirement, CacheTooSmallError, StepFields
from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.registry import PluginRegistry
from qllm.plugins.specs import CacheKindSpec, LayerKindSpec, ModelSpec
from qllm.testing import assert_cache_free, random_prompts, with_decode_graphs

PAGE = 4  # tokens per probe page


@dataclass
class ProbeBatch:
    """``probe_pages``' fields of a step: ``ForwardBatch.caches["probe_pages"]``."""

    pages: torch.Tensor    # [B, W] int32, probe pages per sequence, padded with the padding page
    entries: torch.Tensor  # [T] int64, flat entry (page * PAGE + offset) of each new token


class ProbePool(CachePool):
    """Pages of ``PAGE`` token ids per sequence, storage ``[num_pages + 1, PAGE]`` per layer;
    page ``num_pages`` is the padding page. Remembers the sequences of the last step built."""

    name = "probe_pages"
    unit_name = "page"
    batch_type = ProbeBatch

    def __init__(self, layers: list, num_units: int, device: torch.device):
        super().__init__(layers, num_units, device)
        self.free = list(range(num_units))
        self.pages: dict[int, list[int]] = {}  # seq_id -> pages
        self.step_seqs: list[Sequence] = []
        for layer, req in zip(layers, self.requirements(layers)):
            layer.attach_cache({key: torch.full((num_units + 1, PAGE, *shape), -1,
                                                dtype=req.dtypes[key], device=device)
                                for key, shape in req.shapes.items()})

    def admit(self, seq: Sequence) -> bool:
        self.pages[seq.seq_id] = []
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        pages = self.pages[seq.seq_id]
        missing = self.units_needed(seq.num_computed_tokens + num_new_tokens) - len(pages)
        if missing > len(self.free):
            return False
        pages += [self.free.pop() for _ in range(missing)]
        return True

    def release(self, seq: Sequence) -> None:
        self.free += self.pages.pop(seq.seq_id, [])

    @property
    def num_free_units(self) -> int:
        return len(self.free)

    def units_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // PAGE)

    def step_fields(self, seqs, context_lens, seq_lens, num_padding=0,
                    max_model_len=None, padding_len=1, is_prefill=False) -> StepFields:
        self.step_seqs = list(seqs)
        pages = [self.pages[seq.seq_id] for seq in seqs]
        entries = [table[pos // PAGE] * PAGE + pos % PAGE
                   for table, start, end in zip(pages, context_lens, seq_lens)
                   for pos in range(start, end)]
        entries += [self.padding_unit * PAGE + pos % PAGE
                    for pos in range(padding_len)] * num_padding
        width = self.units_needed(max_model_len) if max_model_len else max(map(len, pages),
                                                                           default=1)
        pages = [table + [self.padding_unit] * (width - len(table)) for table in pages]
        pages += [[self.padding_unit] * width] * num_padding
        return {"pages": (pages, torch.int32), "entries": (entries, torch.int64)}


class TokenProbe(nn.Module):
    """Writes each new token's id to its probe entry and hands the step to ``watch`` (the
    test's checks); the hidden states do not pass through it."""

    layer_kind = "token_probe"

    def __init__(self):
        super().__init__()
        self.watch = None

    def cache_requirement(self) -> CacheRequirement:
        return CacheRequirement(self.layer_kind, {"tokens": ()}, {"tokens": torch.int64})

    def attach_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        self.register_buffer("tokens", tensors["tokens"], persistent=False)  # [P + 1, PAGE]

    def forward(self, input_ids: torch.Tensor, batch) -> None:
        probe = batch.caches["probe_pages"]
        self.tokens.view(-1).index_copy_(0, probe.entries, input_ids)
        if self.watch is not None:
            self.watch(batch, probe, self.tokens)


def probed_qwen3(hf_config, kernels, engine_config):
    from qllm_qwen3.model import Qwen3ForCausalLM

    class ProbedQwen3ForCausalLM(Qwen3ForCausalLM):
        def __init__(self):
            super().__init__(hf_config, kernels, engine_config)
            self.probe = TokenProbe()

        def forward(self, input_ids, positions, batch):
            self.probe(input_ids, batch)
            return super().forward(input_ids, positions, batch)

    return ProbedQwen3ForCausalLM()


class ProbePlugin:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages

    @hookimpl
    def qllm_models(self):
        return [ModelSpec("ProbedQwen3ForCausalLM", probed_qwen3, plugin="test-probe")]

    @hookimpl
    def qllm_cache_kinds(self):
        return [CacheKindSpec(
            name="probe_pages",
            factory=lambda layers, units, config, device: ProbePool(layers, units, device),
            bytes_per_unit=lambda layers, config: PAGE * 8 * len(layers),
            fixed_units=lambda config: self.num_pages)]

    @hookimpl
    def qllm_layer_kinds(self):
        return [LayerKindSpec(name="token_probe", cache_kind="probe_pages")]


@pytest.fixture
def probed_dir(qwen3_dir, tmp_path):
    """The tiny Qwen3 checkpoint, served as ``ProbedQwen3ForCausalLM``."""
    path = tmp_path / "probed"
    shutil.copytree(qwen3_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["ProbedQwen3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def probe_llm(path: str, num_pages: int, **options) -> LLM:
    return LLM(path, plugins=PluginRegistry(extra_plugins=[ProbePlugin(num_pages)]), **options)


def test_plugin_cache_kind_pads_with_its_own_unit_and_serves_its_layer(qwen3_dir, probed_dir):
    prompts = random_prompts([5, 40, 17, 66, 9])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (12, 30, 3, 21, 8)]  # five sequences, then fewer: padded buckets
    expected = LLM(qwen3_dir, block_size=16).generate(prompts, params, use_tqdm=False)
    llm = probe_llm(probed_dir, num_pages=128, block_size=16, max_num_seqs=8,
                    max_model_len=256)
    pool = llm.engine.cache.pools["probe_pages"]
    assert list(llm.engine.cache.pools) == ["paged_kv", "probe_pages"]
    seen = {"rows": 0, "padded_rows": 0}

    def watch(batch, probe, tokens):
        """Every row of the step, as the layer got it: a sequence's row names its own pages
        (never the padding page) and reads its whole history back through them; a padded
        row names the padding page alone."""
        held = {page for pages in pool.pages.values() for page in pages}
        assert pool.padding_unit not in held and pool.padding_unit == pool.num_units
        pages, entries = probe.pages.tolist(), probe.entries.tolist()
        seq_lens, starts = batch.seq_lens.tolist(), batch.query_start_loc.tolist()
        for row, seq in enumerate(pool.step_seqs):
            own = pool.pages[seq.seq_id]
            assert pages[row][:len(own)] == own
            assert set(pages[row][len(own):]) <= {pool.padding_unit}
            history = tokens[probe.pages[row]].flatten()[:seq_lens[row]].tolist()
            known = seq.token_ids[:seq_lens[row]]  # a pending last token is not on the host
            assert history[:len(known)] == known
        for row in range(len(pool.step_seqs), batch.num_seqs):
            assert set(pages[row]) == {pool.padding_unit}
            assert entries[starts[row]:starts[row + 1]] == [pool.padding_unit * PAGE]
        seen["rows"] += len(pool.step_seqs)
        seen["padded_rows"] += batch.num_seqs - len(pool.step_seqs)

    llm.engine.model.probe.watch = watch
    with_decode_graphs(llm, [1, 2, 4, 8])
    assert llm.engine.runner.graphs.inputs[8][2].caches["probe_pages"].pages.shape == (8, 64)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert seen["rows"] > 0 and seen["padded_rows"] > 0
    assert_cache_free(llm)


def test_plugin_cache_kind_too_small_for_max_model_len_raises(probed_dir):
    with pytest.raises(CacheTooSmallError, match=r"the probe_pages cache holds 3 pages, fewer "
                                                 r"than the 16 that one sequence of "
                                                 r"max_model_len=64 needs"):
        probe_llm(probed_dir, num_pages=3, max_model_len=64)
    assert probe_llm(probed_dir, num_pages=16, max_model_len=64).engine.cache.pools[
        "probe_pages"].num_units == 16
