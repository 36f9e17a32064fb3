"""Exact prefix caching for hybrid models (Qwen3.5, Qwen3-Next; issue 26): recurrent-state
checkpoints at KV block boundaries (``qllm.cache.state_checkpoints``). With the cache on,
greedy tokens equal the cache-off run for shared-prefix workloads, hits at and between
checkpoints, under preemption, eviction and slot reuse; a restored state is bit-equal to the
same prefix computed afresh. CPU, fp32, tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, random_prompts
from qllm.testing.kernels import cuda

qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")

BLOCK = 16
ENGINE = dict(block_size=BLOCK, max_model_len=320, num_kv_blocks=128)
CACHED = dict(prefix_state_cache_slots=16)
OFF = dict(enable_prefix_caching=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"{request.param}-prefix"))
    qwen3_5_testing.save_checkpoint(request.param, path, seed=2)
    return path


def shared_prefix_prompts(seed: int = 5) -> list[list[int]]:
    """Prompts sharing a 70-token system prompt (4 full blocks and 6 tokens), and some
    sharing only 40 or 32 of its tokens (hits between and at checkpoints)."""
    system, *suffixes = random_prompts([70, 9, 30, 1, 17, 50, 5, 22], seed=seed)
    prompts = [system + s for s in suffixes[:5]]
    prompts.append(system[:40] + suffixes[5])   # KV hit at 32 (40 is mid-block)
    prompts.append(system[:32] + suffixes[6])   # shares exactly two blocks
    prompts.append(system[:64])                 # a prefix of the system prompt itself
    return prompts


def greedy(max_tokens):
    if isinstance(max_tokens, int):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [greedy(n) for n in max_tokens]


# The first prompt alone (its KV blocks are cached; no checkpoint: nothing shared it yet), the
# second alone (it finds the first's KV blocks, recomputes them and keeps a checkpoint at that
# branch point), the rest but the last together, then the last.
PHASES = (slice(0, 1), slice(1, 2), slice(2, -1), slice(-1, None))


def serve(llm, prompts, params, phases=PHASES):
    """``prompts`` served in ``phases`` (slices of them, one ``generate`` call each, in
    order); the outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [out for phase in phases
            for out in llm.generate(prompts[phase], params[phase], use_tqdm=False)]


@pytest.mark.parametrize("options", [
    pytest.param({}, id="default"),
    pytest.param({"max_num_seqs": 2, "max_num_batched_tokens": 40}, id="slot-reuse-chunked"),
    pytest.param({"async_scheduling": False}, id="sync"),
])
def test_greedy_tokens_equal_the_cache_off_run(checkpoint, options):
    prompts = shared_prefix_prompts()
    params = greedy([12, 20, 5, 16, 9, 30, 8, 11])
    expected = serve(LLM(checkpoint, **ENGINE, **OFF, **options), prompts, params)
    llm = LLM(checkpoint, **ENGINE, **CACHED, **options)
    assert llm.engine.cache.prefix_caching
    outputs = serve(llm, prompts, params)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out["token_ids"] == ref["token_ids"], f"prompt of {len(prompt)} diverged"
    cached = [out["num_cached_tokens"] for out in outputs]
    # the second prompt recomputes the shared 64 and keeps a checkpoint there, the next three
    # restore it; system[:40] recomputes its KV hit of 32 (no checkpoint there: the hit is
    # between checkpoints) and keeps one, which system[:32] restores when admitted after it
    # (with one step for all, it recomputes too); system[:64] (a KV hit of 48: 64 must be
    # computed) restores the one at 32 and recomputes 32..48
    assert cached[:6] == [0, 0, 64, 64, 64, 0] and cached[6] in (0, 32), cached
    assert cached[7] == 32, cached
    stats = llm.engine.cache.prefix_cache_stats()
    assert stats["hit_tokens"] == sum(cached)
    assert stats["recomputed_tokens"] >= 64 + 32 + 16
    assert stats["state_checkpoints_restored"] == sum(n > 0 for n in cached)
    assert stats["state_checkpoints_saved"] == 3  # at 64, 32 and 48
    assert_cache_free(llm)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_requests_finding_a_new_shared_prefix_together_wait_for_one_checkpoint(
        checkpoint, async_scheduling):
    """Requests submitted together that find the same shared KV prefix with no checkpoint:
    the first recomputes it and keeps a checkpoint, the others wait a step (``awaits_prefix``)
    and restore it, so the prefix is recomputed once, not by each; tokens unchanged."""
    system, *suffixes = random_prompts([64, 9, 30, 17, 5], seed=12)
    prompts = [system + s for s in suffixes]
    params = greedy(4)
    settings = dict(ENGINE, async_scheduling=async_scheduling)
    first_alone = (slice(0, 1), slice(1, None))
    expected = serve(LLM(checkpoint, **settings, **OFF), prompts, params, first_alone)
    llm = LLM(checkpoint, **settings, **CACHED)
    outputs = serve(llm, prompts, params, first_alone)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert [o["num_cached_tokens"] for o in outputs] == [0, 0, 64, 64]
    stats = llm.engine.cache.prefix_cache_stats()
    assert stats["recomputed_tokens"] == 64 and stats["state_checkpoints_saved"] == 1
    assert_cache_free(llm)


def test_prompts_sharing_nothing_save_nothing(checkpoint):
    """Without shared prefixes (W2's prompts) the cache costs nothing: no checkpoint is
    kept, no step runs in rounds or eagerly."""
    llm = LLM(checkpoint, **ENGINE, **CACHED)
    engine = llm.engine
    for prompt in random_prompts([70, 33, 48], seed=11):
        seq = engine.add_request(prompt, greedy(3))
        assert not engine.cache.needs_eager(seq, len(prompt))
        while engine.has_unfinished():
            engine.step()
    assert engine.cache.prefix_cache_stats()["state_checkpoints_saved"] == 0


@cuda
def test_greedy_tokens_equal_the_cache_off_run_on_cuda(checkpoint):
    """The same on the GPU kernels, fp32: a 608-token shared prefix whose checkpoint the
    second request saves in a round of 608 tokens (fla's chunked rule, above the recurrent
    kernel's 512) before a round of its own 30; the others restore it. Eager (such steps
    never run as graphs; capturing the decode buckets twice took over 100 s)."""
    system, *suffixes = random_prompts([608, 9, 30, 17, 50], seed=10)
    prompts = [system + s for s in suffixes]
    params = greedy(12)
    settings = dict(ENGINE, max_model_len=1024, num_kv_blocks=320, device="cuda",
                    dtype=torch.float32, enforce_eager=True)
    expected = serve(LLM(checkpoint, **settings, **OFF), prompts, params)
    outputs = serve(LLM(checkpoint, **settings, **CACHED), prompts, params)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert [o["num_cached_tokens"] for o in outputs] == [0, 0, 608, 608]


def test_on_by_default_for_hybrid_models(checkpoint):
    """Prefix caching is exact for hybrid models and on unless asked off; off, no
    checkpoint rows are allocated and nothing is served from the cache."""
    llm = LLM(checkpoint, **ENGINE)
    assert llm.engine.cache.prefix_caching
    assert llm.engine.cache.prefix_cache_stats()["state_checkpoint_capacity"] > 0
    cached = [o["num_cached_tokens"] for o in serve(llm, shared_prefix_prompts(), greedy(3))]
    assert cached[2:5] == [64] * 3, cached
    # unset, the checkpoints take at most 1 GiB: 16 fp32 states of Qwen3.5-35B-A3B (61 MiB
    # each), 32 in bf16, never fewer than one
    from qllm.cache.recurrent_slots import default_state_checkpoints
    assert [default_state_checkpoints(n << 20) for n in (61, 31, 2048)] == [16, 32, 1]
    assert llm.engine.cache.prefix_cache_stats()["state_checkpoint_capacity"] == 32  # tiny
    off = LLM(checkpoint, **ENGINE, **OFF)
    assert not off.engine.cache.prefix_caching
    assert off.engine.cache.pools["recurrent_slot"].checkpoints.num_rows == 0
    out = serve(off, shared_prefix_prompts(), greedy(3))
    assert all(o["num_cached_tokens"] == 0 for o in out)


def test_preemption(checkpoint):
    """A tight KV budget preempts sequences mid-decode; readmitted, they hit their own
    prefix (KV plus a state checkpoint) and still produce the cache-off tokens."""
    prompts = shared_prefix_prompts(seed=6)
    params = greedy([40, 64, 20, 50, 33, 64, 45, 30])
    tight = {**ENGINE, "max_model_len": 192, "num_kv_blocks": 14, "max_num_seqs": 4}
    expected = serve(LLM(checkpoint, **tight, **OFF), prompts, params)
    llm = LLM(checkpoint, **tight, **CACHED)
    outputs = serve(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert_cache_free(llm)


def test_eviction(checkpoint):
    """Two checkpoint rows for many prefixes: LRU eviction, and checkpoints dropped with
    their KV blocks; tokens unchanged."""
    prompts = random_prompts([40, 55, 33, 70, 48, 36], seed=7)
    prompts += [p[:33] + [5, 6, 7] for p in prompts[:3]]  # back to evicted prefixes
    params = greedy(10)
    small = {**ENGINE, "num_kv_blocks": 40}
    expected = [LLM(checkpoint, **small, **OFF).generate([p], params, use_tqdm=False)[0]
                for p in prompts]
    llm = LLM(checkpoint, **small, prefix_state_cache_slots=2)
    outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    stats = llm.engine.cache.prefix_cache_stats()
    assert stats["state_checkpoints_evicted"] > 0 and stats["state_checkpoints"] <= 2
    # forgetting the cached KV blocks drops every checkpoint that pairs with them
    llm.engine.cache.pools["paged_kv"].manager.reset_prefix_cache()
    assert llm.engine.cache.prefix_cache_stats()["state_checkpoints"] == 0
    assert_cache_free(llm)


def slot_state(engine, seq) -> list[torch.Tensor]:
    pool = engine.cache.pools["recurrent_slot"]
    slot = pool.slot(seq)
    return [t[slot].clone() for t in pool.storage]


def test_restored_state_is_bit_equal_to_recomputed(checkpoint):
    """The state copied into a new sequence's slot at a hit equals, bit for bit, the state
    after the same prefix computed afresh by another engine: both compute its 48 tokens in
    one step of 48 (the same matmul shapes: a step of other tokens too may round the shared
    rows' projections differently), the first saving the checkpoint at the step's end."""
    prompt, branch, other = random_prompts([70, 5, 12], seed=8)
    llm = LLM(checkpoint, **ENGINE, **CACHED, async_scheduling=False,
              max_num_batched_tokens=48)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    llm.generate([prompt[:48] + branch], greedy(2), use_tqdm=False)  # saves at 48
    engine = llm.engine
    seq = engine.add_request(prompt[:48] + other, greedy(2))
    batch = engine.scheduler.schedule()  # admission restores the checkpoint after 48 tokens
    assert seq.num_cached_tokens == 48 and batch.num_tokens == [len(other)]
    restored = slot_state(engine, seq)
    engine.abort(seq.request_id)
    assert_cache_free(llm)

    fresh = LLM(checkpoint, **ENGINE, **CACHED, async_scheduling=False,
                max_num_batched_tokens=48).engine
    seq = fresh.add_request(prompt[:48] + other, greedy(2))
    fresh.step()
    assert seq.num_computed_tokens == 48
    recomputed = slot_state(fresh, seq)
    assert all(torch.equal(a, b) for a, b in zip(restored, recomputed))
    assert any(a.abs().sum() > 0 for a in restored)


def test_branch_point_checkpoint_is_saved_inside_the_step(checkpoint):
    """A request whose cached KV prefix no checkpoint covers recomputes it in one step (in
    eager mode, ``needs_eager``), its recurrent layers saving the state at the prefix's end
    on the way (``CheckpointRounds``); the next request sharing the prefix restores it."""
    prompt, branch, other = random_prompts([70, 12, 5], seed=9)
    llm = LLM(checkpoint, **ENGINE, **CACHED, async_scheduling=False)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    engine = llm.engine
    pool = engine.cache.pools["recurrent_slot"]
    assert pool.checkpoints.num_saved == 0
    seq = engine.add_request(prompt[:64] + branch, greedy(2))
    engine.step()
    assert seq.num_cached_tokens == 0 and seq.num_computed_tokens == 64 + len(branch)
    while engine.has_unfinished():
        engine.step()
    assert pool.checkpoints.num_saved == 1
    assert engine.cache.prefix_cache_stats()["recomputed_tokens"] == 64
    probe = engine.add_request(prompt[:64] + other, greedy(1))
    assert pool.longest_prefix(probe, 64) == 64
    engine.abort(probe.request_id)


def test_rounds_plan():
    """Pieces of each round, the rows they compute and the saves after them."""
    from qllm.cache.checkpoint_rounds import CheckpointRounds

    # sequence 0: positions 10..49 in slot 3, saves after 16 and 32 (rows 7, 8); sequence 1:
    # positions 0..7 in slot 5, a save at its end (row 9); sequence 2: none
    plan = CheckpointRounds.plan([3, 5, 6], [10, 0, 4], [50, 8, 6], [True, False, True],
                                 [[(16, 7), (32, 8)], [(8, 9)], []])
    first, second, third = plan.rounds
    assert first.rows == list(range(0, 6)) + list(range(40, 48)) + [48, 49]
    assert (first.query_lens, first.context_lens, first.slots) == ([6, 8, 2], [10, 0, 4],
                                                                    [3, 5, 6])
    assert first.has_state == [True, False, True]
    assert (first.save_slots, first.save_rows) == ([3, 5], [7, 9])
    assert second.rows == list(range(6, 22)) and second.has_state == [True]
    assert (second.save_slots, second.save_rows) == ([3], [8])
    assert third.rows == list(range(22, 40)) and third.save_rows == []
    # saves at chunk ends only: one round over the whole step
    (whole,) = CheckpointRounds.plan([1, 2], [0, 16], [16, 20], [False, True],
                                     [[(16, 4)], []]).rounds
    assert whole.rows is None and whole.save_rows == [4] and whole.query_lens == [16, 4]


def test_metrics_render_the_prefix_cache_counters(checkpoint):
    from qllm.server.metrics import ServerMetrics

    llm = LLM(checkpoint, **ENGINE, **CACHED)
    serve(llm, shared_prefix_prompts(), greedy(2))
    metrics = ServerMetrics()
    metrics.set_prefix_cache_stats(llm.engine.cache.prefix_cache_stats())
    text = metrics.render()
    stats = llm.engine.cache.prefix_cache_stats()
    assert f"qllm_prefix_cache_hit_tokens_total {stats['hit_tokens']}" in text
    assert "qllm_prefix_cache_recomputed_tokens_total " in text
    assert "# TYPE qllm_prefix_cache_state_checkpoints gauge" in text
    assert f"qllm_prefix_cache_state_checkpoint_capacity {CACHED['prefix_state_cache_slots']}" \
        in text
