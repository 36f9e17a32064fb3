"""Prefix caching of a hybrid model: 64 requests sharing a 4,000-token system prompt,
each with its own 200-token suffix and 128 output tokens, with and without the prefix cache
(``prefix_state_cache_slots`` recurrent-state checkpoints), random weights at the
Qwen3.5-35B-A3B geometry (``load_format="dummy"``).

    python benchmarks/prefix_cache.py                       # both modes, on CUDA
    python benchmarks/prefix_cache.py --num-layers 8 --modes on
    python benchmarks/prefix_cache.py --cold                # no request primes the cache
    python benchmarks/prefix_cache.py --model DIR --device cpu --system-tokens 300 \\
        --suffix-tokens 20 --output-tokens 8 --num-requests 4 --max-model-len 1024  # a tiny model

Each mode runs in its own process. Before the timed requests one request with the system
prompt (and a suffix of its own) is served in both modes, as a server with a fixed system
prompt would have served one already (``--cold`` skips it: then requests admitted in the same
step cannot hit each other). The timed requests run ``--passes`` times (2), each pass with
suffixes of its own: in the first, with the cache on, the first requests find the system
prompt's KV blocks but no state checkpoint (one request served it, nothing shared it yet), so
they recompute it and keep one at that branch point; later passes find it, as a server does
once it has seen the system prompt shared. ``--system-prompts 2`` then does the same with a
second system prompt: what its first pass no longer pays was a one-time cost (a compile).
Prints one JSON line per mode, with one entry per pass: mean / p50 / p90 time to first token
(from submission, all requests submitted at once), output throughput, wall seconds, the
prefill steps (``StepTimeline``: tokens and seconds of each, which shows a compile or a
recomputation), the prefix-cache counters (``CacheRegistry.prefix_cache_stats``); and the
commit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from qllm.config import EngineConfig
from step_timeline import StepTimeline
from workloads import QWEN3_5_35B_A3B, commit, write_config


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model_dir: str, cached: bool, args) -> dict:
    from qllm import LLM, SamplingParams

    llm = LLM(model_dir, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enable_prefix_caching=cached,
              prefix_state_cache_slots=args.state_slots if cached else 0,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    vocab = engine.vocab_size
    rng = random.Random(0)
    passes = []
    for prompt_index in range(args.system_prompts):
        system = [rng.randrange(2, vocab) for _ in range(args.system_tokens)]
        if not args.cold:  # the system prompt seen once before (in both modes)
            suffix = [rng.randrange(2, vocab) for _ in range(args.suffix_tokens)]
            llm.generate([system + suffix], SamplingParams(max_tokens=1), use_tqdm=False)
        for _ in range(args.passes):
            suffixes = [[rng.randrange(2, vocab) for _ in range(args.suffix_tokens)]
                        for _ in range(args.num_requests)]
            passes.append({"system_prompt": prompt_index, **timed_pass(
                engine, [system + suffix for suffix in suffixes], args)})
    return {
        "bench": "prefix_cache", "prefix_cache": cached, "cold": args.cold,
        "num_requests": args.num_requests, "system_tokens": args.system_tokens,
        "suffix_tokens": args.suffix_tokens, "output_tokens": args.output_tokens,
        "num_layers": args.num_layers,
        "state_slots": engine.cache.prefix_cache_stats().get("state_checkpoint_capacity", 0),
        "passes": passes, "commit": commit(),
    }


def timed_pass(engine, prompts: list[list[int]], args) -> dict:
    """Submit ``prompts`` at once and serve them to the end: time to first token of each,
    throughput, the prefill steps and what the prefix cache did meanwhile."""
    from qllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    stats_before = engine.cache.prefix_cache_stats()
    timeline = StepTimeline(engine)
    synchronize(args.device)
    start = time.perf_counter()
    seqs = [engine.add_request(prompt, params) for prompt in prompts]
    first_token: dict[int, float] = {}
    while engine.has_unfinished():
        for seq in engine.step():
            if seq.seq_id not in first_token:
                first_token[seq.seq_id] = time.perf_counter() - start
    synchronize(args.device)
    seconds = time.perf_counter() - start
    timeline.stop()
    ttft = sorted(first_token[seq.seq_id] for seq in seqs)
    stats = engine.cache.prefix_cache_stats()
    return {
        "mean_ttft_seconds": round(statistics.fmean(ttft), 4),
        "p50_ttft_seconds": round(ttft[len(ttft) // 2], 4),
        "p90_ttft_seconds": round(ttft[min(len(ttft) - 1, len(ttft) * 9 // 10)], 4),
        "output_tok_per_s": round(sum(seq.num_output_tokens for seq in seqs) / seconds, 1),
        "seconds": round(seconds, 3),
        "prefill": timeline.summary().get("prefill"),
        "cached_tokens": sum(seq.num_cached_tokens for seq in seqs),
        "prefix_cache_stats": {k: v - stats_before.get(k, 0) if k.endswith(
            ("queries", "tokens", "saved", "restored", "evicted")) else v
            for k, v in stats.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint directory (default: the 35B-A3B "
                        "geometry with random weights)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="cut the default geometry to this many layers")
    parser.add_argument("--modes", default="off,on", help="comma-separated: off, on")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--suffix-tokens", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--state-slots", type=int,
                        default=EngineConfig.prefix_state_cache_slots,
                        help="prefix_state_cache_slots with the cache on (default: the "
                             "engine's)")
    parser.add_argument("--passes", type=int, default=2,
                        help="timed passes of --num-requests requests each")
    parser.add_argument("--system-prompts", type=int, default=1,
                        help="system prompts served in turn, each primed and then timed in "
                             "--passes passes (a second one shows which of the first's costs "
                             "are one-time)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cold", action="store_true", help="no request primes the cache")
    args = parser.parse_args()
    if args.model:
        model_dir, args.load_format = args.model, "auto"
    else:
        model_dir, args.load_format = write_config(QWEN3_5_35B_A3B, args.num_layers), "dummy"
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("on", "off"):
            parser.error(f"--modes takes on and off, not {mode!r}")
    if len(modes) == 1:
        print(json.dumps(run(model_dir, modes[0] == "on", args)), flush=True)
        return
    for mode in modes:  # each engine in its own process: two at the real geometry do not fit
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--modes", mode], check=True)


if __name__ == "__main__":
    main()
