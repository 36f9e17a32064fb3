"""The start-up warm-up: one full-size prefill step of dummy prompts, then prefill steps of 1
and 17 tokens, one per power of two below the full size and an odd size between each two,
then a step of one-token prompts as many as fit; nothing left behind (cache, prefix hashes,
requests, counters) and unchanged outputs."""

from __future__ import annotations

import random

import torch

from qllm import LLM, SamplingParams
from qllm.batch import Sequence
from qllm.cache.base import CacheRequirement
from qllm.cache.registry import CacheRegistry
from qllm.config import EngineConfig
from qllm.engine.llm_engine import warm_up_prefill_sizes
from qllm.engine.scheduler import Scheduler
from qllm.plugins.registry import default_registry
from qllm.testing import (assert_cache_free, random_prompts, record_launches, record_replays,
                          with_prefill_graphs)


class CacheLayer(torch.nn.Module):
    """A layer of ``layer_kind`` with a tiny cache entry, for a registry without a model."""

    def __init__(self, layer_kind: str, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.layer_kind, self.shapes = layer_kind, shapes

    def cache_requirement(self) -> CacheRequirement:
        return CacheRequirement(self.layer_kind, self.shapes,
                                dict.fromkeys(self.shapes, torch.float32))

    def attach_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


class HybridLayers(torch.nn.Module):
    """The cache layers of a hybrid model: linear attention and full attention."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([
            CacheLayer("linear_attention", {"conv": (2, 3), "ssm": (1, 2, 2)}),
            CacheLayer("full_attention", {"k": (1, 2), "v": (1, 2)})])

    def cache_layers(self) -> list[torch.nn.Module]:
        return list(self.layers)


def prefill_step_tokens(prompts: list[int], **options) -> list[int]:
    """The token count of each prefill step that the scheduler and the real cache pools
    make of prompts of ``prompts`` tokens (one output token each), all queued at once."""
    config = EngineConfig(model="unused", **options)
    plugins = default_registry()
    cache = CacheRegistry(HybridLayers(), plugins.layer_kinds, plugins.cache_kinds, config,
                          torch.device("cpu"))
    scheduler = Scheduler(config, cache)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for length in prompts:
        scheduler.add(Sequence([rng.randrange(10000) for _ in range(length)], params))
    steps = []
    while (batch := scheduler.schedule()) is not None:
        sampled = [seq for seq, n in zip(batch.seqs, batch.num_tokens)
                   if seq.num_computed_tokens + n == len(seq)]
        scheduler.launched(batch, sampled)
        scheduler.postprocess(batch, sampled, [7] * len(sampled), set())
        if batch.is_prefill:
            steps.append(sum(batch.num_tokens))
    return steps


def size_class(tokens: int) -> tuple[int, str]:
    """The power-of-two range ``tokens`` falls in (its bit length) and its Triton
    specialisation class as an integer kernel argument."""
    kind = "one" if tokens == 1 else "multiple of 16" if tokens % 16 == 0 else "other"
    return tokens.bit_length(), kind


def test_prefill_sizes_give_every_range_both_divisibility_classes():
    sizes = warm_up_prefill_sizes(16384)
    assert sizes[:2] == [1, 17] and max(sizes) < 16384
    warmed = {size_class(n) for n in sizes}
    for bits in range(6, 15):  # [32, 64) ... [8192, 16384): both classes in each range
        assert {(bits, "multiple of 16"), (bits, "other")} <= warmed, bits
    assert 12287 in sizes, "fla's L2 norm tunes per 4,096 tokens: 8,193 to 12,288 too"


def test_w2_prefill_steps_with_the_hybrid_prefix_cache_are_warmed():
    """W2 (200 prompts of 1,000 tokens, 16,384-token steps, 256-token KV blocks) with 64
    state checkpoints: the steps of the cache-off run (checkpoints are saved inside the
    steps, not by cutting them), each of a size the warm-up ran."""
    w2 = dict(max_num_seqs=200, max_model_len=3072, num_kv_blocks=200 * 12)
    steps = prefill_step_tokens([1000] * 200, prefix_state_cache_slots=64, **w2)
    assert sum(steps) == 200 * 1000 and len(steps) == 13, steps
    assert steps == prefill_step_tokens([1000] * 200, **w2)
    warmed = {size_class(n) for n in warm_up_prefill_sizes(16384)} | {size_class(16384)}
    missing = [n for n in steps if size_class(n) not in warmed]
    assert not missing, f"W2 steps of {missing} tokens would compile while serving"


def test_warm_up_runs_full_prefill_then_ladder_and_leaves_nothing_behind(qwen3_dir, monkeypatch):
    engine_options = dict(block_size=16, max_model_len=256, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([10, 40, 100])
    expected = LLM(qwen3_dir, **engine_options).generate(prompts, params, use_tqdm=False)

    llm = LLM(qwen3_dir, **engine_options)
    engine = llm.engine
    launched = record_launches(engine, monkeypatch)
    draws = []
    monkeypatch.setattr(engine.runner, "sample_tokens",
                        lambda logits, temperature, seed: draws.append((logits, temperature)))
    engine.warm_up()
    assert launched[0][::2] == (True, 512), "the first warm-up step should be a full prefill"
    (logits, temperature), = draws  # one temperature draw, in the model's dtype
    assert logits.shape == (1, engine.vocab_size) and logits.dtype == engine.config.dtype
    assert temperature.tolist() == [1.0]
    assert any(not is_prefill for is_prefill, _, _ in launched), "and a decode step should run"
    prefills = [(n, seqs) for is_prefill, seqs, n in launched if is_prefill]
    assert [n for n, _ in prefills] == [512, 1, 17, 16, 32, 47, 64, 95, 128, 191, 256, 383,
                                        256], \
        "then the odd sizes, the powers of two and odd sizes between, the one-token prompts"
    assert prefills[-1] == (256, 256), "a step of max_num_seqs one-token prompts"
    assert_cache_free(llm)
    assert not engine.cache.pools["paged_kv"].manager.cached, "warm-up prefixes must go"
    assert not engine.sequences and engine.scheduler.num_preemptions == 0
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]


def test_warm_up_runs_prefill_eagerly_where_prefill_graphs_would_replay(qwen3_dir):
    """The warm-up's one-prompt steps of up to a prefill graph's size run the layers eagerly
    (their kernels compile for a step of any sequences); serving replays the graphs after."""
    llm = with_prefill_graphs(LLM(qwen3_dir, block_size=16, max_model_len=256,
                                  max_num_batched_tokens=64), [16, 32])
    graphs = llm.engine.runner.prefill_graphs
    replayed = record_replays(graphs)
    llm.engine.warm_up()
    assert not replayed, "a warm-up prefill step replayed a graph"
    assert llm.engine.runner.prefill_graphs is graphs
    llm.generate(random_prompts([20]), SamplingParams(max_tokens=2), use_tqdm=False)
    assert replayed == [32]
