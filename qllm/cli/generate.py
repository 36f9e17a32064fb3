"""``qllm generate``: text for prompts, printed."""

from __future__ import annotations

import argparse
import json
import sys

from qllm.cli.options import (HelpFormatter, add_engine_options, add_model_option,
                              engine_options)
from qllm.config import SamplingParams

DEFAULT_PROMPT = "The capital of France is"


def add_generate_command(subparsers) -> None:
    """Add ``generate`` to the ``qllm`` command's subparsers."""
    parser = subparsers.add_parser("generate", help="generate text for prompts",
                                   formatter_class=HelpFormatter)
    add_model_option(parser)
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
    from qllm.model.default_model import default_model_dir

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
