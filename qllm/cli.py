"""The ``qllm`` command line: ``qllm generate`` and ``qllm serve``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from qllm import __version__
from qllm.cache.registry import CacheTooSmallError
from qllm.config import EngineConfig, SamplingParams

DEFAULT_PROMPT = "The capital of France is"
# What a user got wrong (a bad option, a missing model, too little cache memory): one
# `qllm: error:` line, no traceback.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError,
               CacheTooSmallError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default: argparse's "(default: X)", unless the help
    already says it in words."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that builds an engine; their defaults are
    ``EngineConfig``'s."""
    default = {f.name: f.default for f in fields(EngineConfig)}
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", help="auto (the checkpoint's dtype), bfloat16, float16 or "
                                       "float32 (default: fp32 on CPU, the checkpoint's half "
                                       "precision on GPU)")
    group.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    group.add_argument("--max-num-seqs", type=int, default=default["max_num_seqs"],
                       help="sequences decoded together")
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=default["max_num_batched_tokens"], help="tokens per prefill step")
    group.add_argument("--max-model-len", type=int,
                       help="longest prompt + output (default: the model's "
                            "max_position_embeddings)")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=default["gpu_memory_utilization"],
                       help="fraction of the GPU's memory the engine may use")
    group.add_argument("--kv-cache-memory-bytes", type=int,
                       help="memory for the KV cache (default: 2 GiB on CPU, what the GPU "
                            "memory utilization leaves on CUDA)")
    group.add_argument("--block-size", type=int, default=default["block_size"],
                       help="tokens per KV-cache block")
    group.add_argument("--enforce-eager", action="store_true",
                       help="no torch.compile / CUDA graphs")
    group.add_argument("--load-format", choices=["auto", "safetensors", "dummy"],
                       default=default["load_format"],
                       help="dummy: random weights from config.json alone")
    group.add_argument("--compile-cache-dir",
                       help="the persistent torch.compile / Triton cache, or off (default: "
                            "$QLLM_CACHE_DIR, else ~/.cache/qllm)")
    group.add_argument("--tensor-parallel-size", type=int,
                       default=default["tensor_parallel_size"],
                       help="GPUs to split the model over (one process each; under torchrun, "
                            "the world size)")
    group.add_argument("--quantization", help="weight format from a plugin, e.g. int8 or fp8 "
                                              "(qllm-kernels-int8); a quantized checkpoint's "
                                              "own format is used without it")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as ``LLM`` keyword arguments."""
    names = ["dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "gpu_memory_utilization", "kv_cache_memory_bytes", "block_size", "enforce_eager",
             "load_format", "quantization", "compile_cache_dir", "tensor_parallel_size"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for prompts",
                                   formatter_class=HelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: a built-in small "
                                        "Qwen3 with random weights)")
    parser.add_argument("--prompt", action="append", default=[],
                        help=f"a prompt, repeat for several (default: {DEFAULT_PROMPT!r} "
                             f"when neither --prompt nor --prompts-file is given)")
    parser.add_argument("--prompts-file", help="a file with one prompt per line")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    parser.add_argument("--top-k", type=int, default=-1, help="top-k sampling; -1 is off")
    parser.add_argument("--seed", type=int, help="sampling seed (default: none, unseeded)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument("--stop", action="append", default=[],
                        help="a stop string, repeat for several")
    parser.add_argument("--json", action="store_true", help="print one JSON line per prompt")
    add_engine_options(parser)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from qllm import LLM
    from qllm.default_model import default_model_dir

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed,
                            ignore_eos=args.ignore_eos, stop=args.stop)
    model = args.model
    if model is None:
        model = default_model_dir()
        print(f"qllm: no --model given; using the built-in default model at {model}. "
              f"Its weights are RANDOM, so its text is gibberish.", file=sys.stderr)
    llm = LLM(model, **engine_options(args))
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out["text"],
                              "token_ids": out["token_ids"],
                              "finish_reason": out["finish_reason"]}))
        else:
            print(f"--- prompt: {prompt!r}\n{out['text']}\n[{len(out['token_ids'])} tokens, "
                  f"finish: {out['finish_reason']}]")
    stats = llm.last_throughput
    print(f"qllm: {stats['generated_tokens']} tokens in {stats['seconds']:.2f} s "
          f"({stats['tokens_per_second']:.1f} tok/s)", file=sys.stderr)
    return 0


def _add_serve(subparsers) -> None:
    try:
        from qllm.server.cli import add_serve_command
    except ImportError:
        return  # the server is an optional extra: `pip install -e ".[serve]"`
    add_serve_command(subparsers)


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; a ``USER_ERRORS`` error prints one ``qllm: error:`` line and
    returns 2."""
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"qllm: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """The ``qllm`` command (also ``python -m qllm``)."""
    parser = argparse.ArgumentParser(prog="qllm", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"qllm {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_serve(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
