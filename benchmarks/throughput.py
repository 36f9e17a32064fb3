"""Throughput harness for the workloads of shared/bench/WORKLOADS.md, with random weights at the
real geometry (``load_format="dummy"`` on a config.json this script writes).

    python benchmarks/throughput.py --workload w1                     # qllm
    python benchmarks/throughput.py --workload w1 --logprobs 5        # top-5 log-probs too
    python benchmarks/throughput.py --workload w1 --engine transformers --peer-prompts 64
    python benchmarks/throughput.py --workload w2 --engine transformers --peer-prompts 32 \
        --peer-batch 32 --peer-max-tokens 200

Prints one JSON line per run: engine, workload, tokens, seconds, tok/s, peak memory, commit;
for qllm also the timed run's steps split into prefill and decode (``StepTimeline``) and the
start-up's split (``startup``: model load, compile, graph capture, warm-up, and whether the
compile cache was cold or warm; ``QLLM_CACHE_DIR`` chooses the cache). With
``--profile-decode BATCH CONTEXT`` the same engine then profiles decode steps at that batch
and context (``profile_step.py``; figures under ``decode_profile``, files under ``$OUT``),
which saves a second start-up; ``--startup-only`` stops after the start-up, and
``--dump-fla-configs ROOT`` writes the configs fla's autotuned kernels picked by then to
``ROOT/<GPU name>/``, the layout of the configs kernels_gdn ships
(``qllm_kernels_gdn.fla_configs``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import profile_step
from qllm.config import EngineConfig
from step_timeline import StepTimeline
from workloads import commit, workload, write_config


def kernel_pin(text: str) -> tuple[str, str]:
    """``OP=NAME`` -> ``(op, name)``, for ``LLM(kernels=...)``."""
    op, sep, name = text.partition("=")
    if not sep or not op or not name:
        raise argparse.ArgumentTypeError(f"expected OP=NAME, got {text!r}")
    return op, name


def run_qllm(model_dir: str, prompts, params, args) -> dict:
    from qllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, async_scheduling=not args.sync_scheduling,
              recurrent_state_dtype=args.recurrent_state_dtype,
              max_autotune_gemm=args.max_autotune_gemm, kernels=dict(args.kernel),
              quantization=args.quantization,
              prefix_state_cache_slots=args.prefix_state_cache_slots,
              tensor_parallel_size=args.tensor_parallel_size)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    startup = time.perf_counter() - start
    if args.dump_fla_configs:
        from qllm_kernels_gdn.fla_configs import gpu_folder_name, write_configs

        folder = Path(args.dump_fla_configs) / gpu_folder_name(torch.cuda.get_device_name())
        print(f"fla configs: {len(write_configs(folder))} kernels written to {folder}")
    if args.startup_only:
        return {"startup_seconds": round(startup, 1), "startup": llm.engine.startup.summary()}
    sampling = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True,
                               logprobs=args.logprobs) for m, t in params]
    result = {}
    if len(prompts) == 1:  # a latency workload: time to first token, then decode speed
        # The first request of a prompt length may still compile kernels for its prefill
        # shapes (the start-up warm-up covers powers of two): reported apart, and the decode
        # speed is taken from warm runs.
        first = [SamplingParams(temperature=t, max_tokens=1, ignore_eos=True,
                                logprobs=args.logprobs) for _, t in params]
        result["first_request_ttft_seconds"] = round(_timed(llm, prompts, first)[1], 4)
        result["ttft_seconds"] = round(_timed(llm, prompts, first)[1], 4)
        if llm.engine.runner.prefill_graphs is not None:  # the same prompt, prefilled eagerly
            with llm.engine.runner.eager_prefill():
                result["ttft_eager_seconds"] = round(_timed(llm, prompts, first)[1], 4)
    timeline = StepTimeline(llm.engine)
    outputs, seconds = _timed(llm, prompts, sampling)
    result["steps"] = timeline.summary()
    if args.profile_decode:
        batch, context = args.profile_decode
        profile_step.queue_requests(llm.engine, "decode", batch, context, args.profile_steps)
        tag = f"{args.workload}-decode-b{batch}-ctx{context}"
        figures = profile_step.profile_steps(llm.engine, tag, args.profile_steps,
                                             args.profile_out)
        result["decode_profile"] = {"batch": batch, "context": context, **figures}
    tokens = sum(len(o["token_ids"]) for o in outputs)
    if len(prompts) == 1:
        result["decode_tok_per_s"] = round((tokens - 1) / (seconds - result["ttft_seconds"]), 1)
    graphs = llm.engine.runner.graphs
    return {**result, "tokens": tokens, "seconds": seconds, "startup_seconds": round(startup, 1),
            "startup": llm.engine.startup.summary(),
            "kernels": llm.engine.kernels.names(),
            "cache_units": {name: pool.num_units
                            for name, pool in llm.engine.cache.pools.items()},
            "weights_gib": round(weight_bytes(llm.engine.model) / 2**30, 2),
            "decode_graph_sizes": graphs.sizes if graphs else None}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's checkpoint tensors (its state dict, tied tensors once; the cache
    pools are not in it)."""
    unique = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    return sum(unique.values())


def _timed(llm, prompts, sampling) -> tuple[list[dict], float]:
    """``llm.generate`` outputs and wall seconds, GPU work included, from an empty prefix
    cache (the latency workload serves its prompt more than once: none may hit the last)."""
    llm.engine.cache.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


def run_transformers(model_dir: str, prompts, params, args) -> dict:
    """transformers ``generate`` in left-padded batches of ``--peer-batch`` prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    tokens, seconds = 0, 0.0
    for start in range(0, len(prompts), args.peer_batch):
        chunk = prompts[start:start + args.peer_batch]
        chunk_params = params[start:start + args.peer_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                            device="cuda")
        max_new = max(m for m, _ in chunk_params)
        if args.peer_max_tokens:
            max_new = min(max_new, args.peer_max_tokens)
            chunk_params = [(min(m, max_new), t) for m, t in chunk_params]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=chunk_params[0][1] > 0,
                           temperature=chunk_params[0][1] or None,
                           pad_token_id=0)
        torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        tokens += sum(m for m, _ in chunk_params)  # useful tokens only
    return {"tokens": tokens, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1")
    parser.add_argument("--engine", choices=["qllm", "transformers"], default="qllm")
    parser.add_argument("--num-layers", type=int, help="fewer layers than the real model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-autotune-gemm", action="store_true",
                        help="Inductor GEMM autotuning in the decode layers (it reaches the "
                             "projections only with --kernel linear=torch)")
    parser.add_argument("--quantization", help="weight format, e.g. int8 or fp8 "
                                               "(qllm-kernels-int8): the random weights are "
                                               "quantized at load")
    parser.add_argument("--kernel", action="append", default=[], type=kernel_pin,
                        metavar="OP=NAME", help="pin an op to a named implementation, e.g. "
                                                "linear=torch (repeatable)")
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="read each step's tokens before scheduling the next")
    parser.add_argument("--recurrent-state-dtype", default="float32",
                        help="GDN state dtype of hybrid models (float32 or bfloat16)")
    parser.add_argument("--prefix-state-cache-slots", type=int,
                        default=EngineConfig.prefix_state_cache_slots,
                        help="recurrent-state checkpoints of the hybrid prefix cache (0: off; "
                             "default: the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs the model is split over (W2 at TP=2 against TP=1)")
    parser.add_argument("--logprobs", type=int, help="every request asks for the top-K "
                        "log-probs of each generated token (qllm only)")
    parser.add_argument("--peer-prompts", type=int, help="run only the first N prompts")
    parser.add_argument("--peer-batch", type=int, default=64)
    parser.add_argument("--peer-max-tokens", type=int,
                        help="cap the peer's generated tokens per prompt (a shorter peer run)")
    parser.add_argument("--profile-decode", nargs=2, type=int, metavar=("BATCH", "CONTEXT"),
                        help="qllm: after the timed run, profile decode steps at this batch "
                             "and prompt length on the same engine")
    parser.add_argument("--startup-only", action="store_true",
                        help="qllm: time the start-up (to the first tokens) and stop")
    parser.add_argument("--dump-fla-configs", metavar="ROOT",
                        help="qllm: after the start-up, write the configs fla's autotuned "
                             "kernels picked to ROOT/<GPU name>/ (kernels_gdn's layout)")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--profile-out", default=os.environ.get("OUT", "profile-out"))
    args = parser.parse_args()
    if args.profile_decode:
        batch, context = args.profile_decode
        model_len = profile_step.model_len_needed(context, args.profile_steps)
        if batch > args.max_num_seqs or model_len > args.max_model_len:
            parser.error(f"--profile-decode {batch} {context} needs --max-num-seqs >= {batch} "
                         f"and --max-model-len >= {model_len}")
    if not torch.cuda.is_available():
        print("throughput.py needs a CUDA device", file=sys.stderr)
        return 2
    config, prompts, params = workload(args.workload)
    if args.peer_prompts:
        prompts, params = prompts[:args.peer_prompts], params[:args.peer_prompts]
    model_dir = write_config(config, args.num_layers)
    torch.cuda.reset_peak_memory_stats()
    run = run_qllm if args.engine == "qllm" else run_transformers
    result = run(model_dir, prompts, params, args)
    if args.engine == "qllm":
        result.update(async_scheduling=not args.sync_scheduling,
                      recurrent_state_dtype=args.recurrent_state_dtype,
                      max_autotune_gemm=args.max_autotune_gemm, kernel_pins=dict(args.kernel),
                      quantization=args.quantization, logprobs=args.logprobs,
                      prefix_state_cache_slots=args.prefix_state_cache_slots,
                      tensor_parallel_size=args.tensor_parallel_size)
    if "tokens" in result:
        result["tok_per_s"] = round(result["tokens"] / result["seconds"], 1)
    result.update(engine=args.engine, workload=args.workload, prompts=len(prompts),
                  peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit(),
                  num_layers=args.num_layers, date=time.strftime("%Y-%m-%d"))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
