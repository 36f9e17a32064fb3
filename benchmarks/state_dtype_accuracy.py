"""Accuracy cost of keeping the Gated DeltaNet recurrent state in bf16 instead of fp32.

Runs the same hybrid model twice, ``recurrent_state_dtype`` fp32 and bf16, and reports
(a) greedy agreement over ``--tokens`` generated tokens per prompt and (b) the cosine between
the two engines' next-token logits at every step of the fp32 engine's continuation, fed one
token per step so the state is stored (and rounded) after every token, as in decode.

    python benchmarks/state_dtype_accuracy.py                      # tiny random model, CPU
    python benchmarks/state_dtype_accuracy.py --device cuda --dtype bfloat16 \
        --real-geometry-layers 4
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch

from qllm import LLM, SamplingParams
from qllm.engine.diagnostics import teacher_forced_logits


def run(path: str, args, state_dtype: str, prompts, greedy, continuations=None):
    """Greedy outputs of an engine with ``state_dtype``, and its teacher-forced logits on
    ``continuations`` (its own outputs when None). One engine at a time, to fit the real
    geometry in host memory."""
    llm = LLM(path, device=args.device, dtype=args.dtype, enforce_eager=True,
              recurrent_state_dtype=state_dtype, max_model_len=2048)
    outputs = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    logits = teacher_forced_logits(llm, prompts, continuations or outputs)
    del llm
    gc.collect()
    return outputs, logits


def main() -> None:
    from qllm_qwen3_5 import testing

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="qwen3_5", choices=testing.KINDS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--real-geometry-layers", type=int,
                        help="instead of a tiny model: Qwen3.5-35B-A3B geometry, this many layers")
    args = parser.parse_args()

    path = tempfile.mkdtemp(prefix="qllm-state-dtype-")
    if args.real_geometry_layers:
        args.kind = "qwen3_5_moe (35B-A3B geometry)"
        testing.build_real_geometry_model(args.real_geometry_layers, args.device,
                                          getattr(torch, args.dtype)).save_pretrained(path)
        gc.collect()  # transformers' model holds reference cycles: free it before loading
        vocab = 10000
    else:
        testing.save_checkpoint(args.kind, path, max_position_embeddings=2048)
        vocab = 512
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(20, 200, (args.prompts,), generator=generator)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    reference, ref_logits = run(path, args, "float32", prompts, greedy)
    outputs, test_logits = run(path, args, "bfloat16", prompts, greedy, reference)
    matching, first_divergence = 0, []
    for ref, test in zip(reference, outputs):
        pairs = list(zip(ref, test))
        matching += sum(a == b for a, b in pairs)
        first_divergence.append(next((i for i, (a, b) in enumerate(pairs) if a != b),
                                     len(pairs)))
    cosine = torch.nn.functional.cosine_similarity(ref_logits, test_logits, dim=-1)
    print(json.dumps({
        "kind": args.kind, "layers": args.real_geometry_layers, "device": args.device,
        "dtype": args.dtype,
        "prompts": len(prompts), "tokens_per_prompt": args.tokens,
        "greedy_token_agreement": round(matching / (len(prompts) * args.tokens), 4),
        "first_divergence_median": sorted(first_divergence)[len(first_divergence) // 2],
        "identical_sequences": sum(d == args.tokens for d in first_divergence),
        "logits_cosine_min": round(cosine.min().item(), 6),
        "logits_cosine_mean": round(cosine.mean().item(), 6)}))


if __name__ == "__main__":
    main()
