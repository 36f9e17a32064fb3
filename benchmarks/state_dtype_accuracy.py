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
import json
import tempfile

import torch

from qllm import LLM, SamplingParams
from qllm.engine.scheduler import ScheduledBatch
from qllm.engine.sequence import Sequence


@torch.inference_mode()
def stepwise_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Next-token logits ``[len - 1, V]`` after each prefix, computing one token per step."""
    engine = llm.engine
    seq = Sequence(token_ids, SamplingParams(temperature=0))
    assert engine.cache.admit(seq)
    rows = []
    try:
        for _ in range(len(token_ids) - 1):
            assert engine.cache.reserve(seq, 1)
            input_ids, positions, batch = engine.runner.prepare(
                ScheduledBatch([seq], [1], is_prefill=True))
            hidden = engine.model(input_ids, positions, batch)
            rows.append(engine.model.compute_logits(hidden)[0])
            seq.num_computed_tokens += 1
    finally:
        engine.cache.release(seq)
    return torch.stack(rows)


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
        vocab = 10000
    else:
        testing.save_checkpoint(args.kind, path, max_position_embeddings=2048)
        vocab = 512
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(20, 200, (args.prompts,), generator=generator)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engines = {state: LLM(path, device=args.device, dtype=args.dtype, enforce_eager=True,
                          recurrent_state_dtype=state, max_model_len=2048)
               for state in ("float32", "bfloat16")}
    outputs = {state: llm.generate(prompts, greedy, use_tqdm=False)
               for state, llm in engines.items()}
    matching, first_divergence, cosines = 0, [], []
    for prompt, ref, test in zip(prompts, outputs["float32"], outputs["bfloat16"]):
        pairs = list(zip(ref["token_ids"], test["token_ids"]))
        matching += sum(a == b for a, b in pairs)
        first_divergence.append(next((i for i, (a, b) in enumerate(pairs) if a != b),
                                     len(pairs)))
        full = prompt + ref["token_ids"]
        ref_logits, test_logits = (stepwise_logits(engines[s], full) for s in engines)
        cosines.append(torch.nn.functional.cosine_similarity(ref_logits, test_logits, dim=-1))
    cosine = torch.cat(cosines)
    print(json.dumps({
        "kind": args.kind, "layers": args.real_geometry_layers, "device": args.device, "dtype": args.dtype,
        "prompts": len(prompts), "tokens_per_prompt": args.tokens,
        "greedy_token_agreement": round(matching / (len(prompts) * args.tokens), 4),
        "first_divergence_median": sorted(first_divergence)[len(first_divergence) // 2],
        "identical_sequences": sum(d == args.tokens for d in first_divergence),
        "logits_cosine_min": round(cosine.min().item(), 6),
        "logits_cosine_mean": round(cosine.mean().item(), 6)}))


if __name__ == "__main__":
    main()
