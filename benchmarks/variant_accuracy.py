"""Accuracy cost of a cheaper engine variant against its reference, on the same weights: the
Gated DeltaNet state in bf16 instead of fp32 (``--variant state-bf16``), 8-bit weights
instead of the checkpoint's (``--variant int8``, ``fp8``, ``int8-experts``, ``fp8-experts``;
qllm-kernels-int8), or bf16 itself against fp32 (``--variant bf16``: the scale the others
are read against, since random-weight models amplify any rounding alike).

Runs the same hybrid model twice, reference then variant, and reports (a) greedy agreement
over ``--tokens`` generated tokens per prompt; (b) at every position of the reference's
continuation (``prompts x tokens`` positions), fed one token per step so that the state is
stored (and rounded) after every token, as in decode: the cosine between the two engines'
next-token logits (min, mean) and how often their argmax agrees.

    python benchmarks/variant_accuracy.py                          # tiny random model, CPU
    python benchmarks/variant_accuracy.py --variant int8 --device cuda --dtype bfloat16 \\
        --real-geometry-layers 4                                   # 8 x 256 = 2,048 positions
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch

from qllm import LLM, SamplingParams
from qllm.engine.diagnostics import teacher_forced_logits

# variant -> (the reference engine's options, the variant's)
VARIANTS = {
    "state-bf16": ({"recurrent_state_dtype": "float32"}, {"recurrent_state_dtype": "bfloat16"}),
    "bf16": ({"dtype": "float32"}, {"dtype": "bfloat16"}),
    **{fmt: ({}, {"quantization": fmt})
       for fmt in ("int8", "fp8", "int8-experts", "fp8-experts")},
}


def run(path: str, args, options: dict, prompts, greedy, continuations=None):
    """Greedy outputs of an engine with ``options``, and its teacher-forced logits on
    ``continuations`` (its own outputs when None). One engine at a time, to fit the real
    geometry in host memory."""
    llm = LLM(path, **{"device": args.device, "dtype": args.dtype, "enforce_eager": True,
                       "max_model_len": 2048, "max_num_seqs": len(prompts), **options})
    outputs = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    logits = teacher_forced_logits(llm, prompts, continuations or outputs)
    del llm
    gc.collect()
    return outputs, logits


def compare(args) -> dict:
    """The report of one comparison (``args`` as ``main``'s parser gives them)."""
    from qllm_qwen3_5 import testing

    path = tempfile.mkdtemp(prefix="qllm-variant-accuracy-")
    kind = args.kind
    if args.real_geometry_layers:
        kind = "qwen3_5_moe (35B-A3B geometry)"
        testing.build_real_geometry_model(args.real_geometry_layers, args.device,
                                          getattr(torch, args.dtype)).save_pretrained(path)
        gc.collect()  # transformers' model holds reference cycles: free it before loading
        vocab = 10000
    else:
        testing.save_checkpoint(kind, path, max_position_embeddings=2048)
        vocab = 512
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(20, 200, (args.prompts,), generator=generator)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    reference_options, variant_options = VARIANTS[args.variant]
    reference, ref_logits = run(path, args, reference_options, prompts, greedy)
    outputs, test_logits = run(path, args, variant_options, prompts, greedy, reference)
    matching, first_divergence = 0, []
    for ref, test in zip(reference, outputs):
        pairs = list(zip(ref, test))
        matching += sum(a == b for a, b in pairs)
        first_divergence.append(next((i for i, (a, b) in enumerate(pairs) if a != b),
                                     len(pairs)))
    cosine = torch.nn.functional.cosine_similarity(ref_logits, test_logits, dim=-1)  # [S, B]
    argmax_equal = ref_logits.argmax(-1) == test_logits.argmax(-1)  # [S, B]
    return {
        "variant": args.variant, "reference": reference_options, "options": variant_options,
        "kind": kind, "layers": args.real_geometry_layers, "device": args.device,
        "dtype": args.dtype, "prompts": len(prompts), "tokens_per_prompt": args.tokens,
        "positions": cosine.numel(),
        "greedy_token_agreement": round(matching / (len(prompts) * args.tokens), 4),
        "first_divergence_median": sorted(first_divergence)[len(first_divergence) // 2],
        "identical_sequences": sum(d == args.tokens for d in first_divergence),
        "logits_cosine_min": round(cosine.min().item(), 6),
        "logits_cosine_mean": round(cosine.mean().item(), 6),
        "argmax_agreement": round(argmax_equal.float().mean().item(), 4)}


def parser() -> argparse.ArgumentParser:
    from qllm_qwen3_5 import testing

    found = argparse.ArgumentParser(description=__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("--variant", default="state-bf16", choices=list(VARIANTS))
    found.add_argument("--kind", default="qwen3_5", choices=testing.KINDS)
    found.add_argument("--device", default="cpu")
    found.add_argument("--dtype", default="float32")
    found.add_argument("--prompts", type=int, default=8)
    found.add_argument("--tokens", type=int, default=256)
    found.add_argument("--real-geometry-layers", type=int,
                       help="instead of a tiny model: Qwen3.5-35B-A3B geometry, this many layers")
    return found


def main() -> None:
    print(json.dumps(compare(parser().parse_args())))


if __name__ == "__main__":
    main()
