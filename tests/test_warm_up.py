"""The start-up warm-up: one full-size prefill step of dummy prompts, then prefill steps of 1
and 17 tokens and one per power of two below the full size, then a step of one-token prompts
as many as fit; nothing left behind (cache, prefix hashes, requests, counters) and unchanged
outputs."""

from __future__ import annotations

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, random_prompts


def test_warm_up_runs_full_prefill_then_ladder_and_leaves_nothing_behind(qwen3_dir, monkeypatch):
    engine_options = dict(block_size=16, max_model_len=256, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([10, 40, 100])
    expected = LLM(qwen3_dir, **engine_options).generate(prompts, params, use_tqdm=False)

    llm = LLM(qwen3_dir, **engine_options)
    engine = llm.engine
    launched = []
    launch = engine.runner.launch

    def recording_launch(batch, previous=None, **options):
        launched.append((batch.is_prefill, sum(batch.num_tokens), len(batch.seqs)))
        return launch(batch, previous, **options)

    monkeypatch.setattr(engine.runner, "launch", recording_launch)
    engine.warm_up()
    assert launched[0][:2] == (True, 512), "the first warm-up step should be a full prefill"
    assert any(not is_prefill for is_prefill, _, _ in launched), "and a decode step should run"
    prefills = [(n, seqs) for is_prefill, n, seqs in launched if is_prefill]
    assert [n for n, _ in prefills] == [512, 1, 17, 16, 32, 64, 128, 256, 256], \
        "then the odd sizes, one prefill per power of two and the one-token prompts"
    assert prefills[-1] == (256, 256), "a step of max_num_seqs one-token prompts"
    assert_cache_free(llm)
    assert not engine.cache.pools["paged_kv"].manager.cached, "warm-up prefixes must go"
    assert not engine.sequences and engine.scheduler.num_preemptions == 0
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
