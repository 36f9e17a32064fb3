"""How the cache registry sizes a budget-sized pool: from the memory asked for, else on the CPU
no more than the engine's sequences can hold at once."""

from __future__ import annotations

from qllm import LLM


def paged_kv_blocks(llm) -> int:
    return llm.engine.cache.pools["paged_kv"].num_units


def test_cpu_default_budget_allocates_only_what_sequences_can_use(qwen3_dir):
    """4 sequences of up to 256 tokens in blocks of 16 hold 64 blocks at most: the CPU's
    default budget (a ceiling) allocates those, not gigabytes."""
    llm = LLM(qwen3_dir, max_num_seqs=4, max_model_len=256, block_size=16)
    assert paged_kv_blocks(llm) == 4 * 256 // 16


def test_memory_asked_for_is_allocated_in_full(qwen3_dir):
    """An explicit budget or block count is honoured as given, beyond what can be in use."""
    sized = LLM(qwen3_dir, max_num_seqs=4, max_model_len=256, block_size=16,
                kv_cache_memory_bytes=64 << 20)
    assert paged_kv_blocks(sized) > 4 * 256 // 16
    counted = LLM(qwen3_dir, max_num_seqs=4, max_model_len=256, block_size=16,
                  num_kv_blocks=100)
    assert paged_kv_blocks(counted) == 100
