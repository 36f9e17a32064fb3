"""What the ``qllm`` subcommands share: the engine options, ``--help``'s format, and how a
command's error reaches the user."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from qllm.cache.registry import CacheTooSmallError
from qllm.config import EngineConfig

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


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model``, the checkpoint every command that builds an engine serves."""
    parser.add_argument("--model", help="checkpoint directory (default: a built-in small "
                                        "Qwen3 with random weights)")


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


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; a ``USER_ERRORS`` error prints one ``qllm: error:`` line and
    returns 2."""
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"qllm: error: {exc}", file=sys.stderr)
        return 2
