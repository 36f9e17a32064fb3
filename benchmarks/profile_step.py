"""Profile engine steps of a workload's model at a fixed batch (torch profiler, CUDA).

``--phase decode`` admits ``--batch`` sequences of ``--context`` prompt tokens and prefills
them; a unit is then one decode step. ``--phase prefill``: a unit is the whole prefill of
``--batch`` fresh prompts of ``--context`` tokens (admitted together, one token sampled each,
in as many steps as it takes: for one short prompt, its time to first token). Then
(a) times ``--steps`` units as the engine runs them (CUDA graphs where captured),
(b) profiles the next ``--steps``: GPU busy time per unit and the idle gaps between kernels
(a unit whose wall time is far above its GPU busy time is bound by the host's launches),
(c) sums kernel time by op kind (GDN, attention, MoE, GEMM, sampling, other) per unit, and
the elapsed time each kind adds to the unit's span (``elapsed_by_kind``: it adds up where
kernel times overlap, as under programmatic dependent launch), and the same for the kernels
that cost the most (``elapsed_by_kernel``: the router, gate-up and down apart).
Writes a Chrome trace, the top-kernel table and the kernel sequence of the last profiled
step (duration, idle gap before it, op kind, name: one layer's kernels read top to bottom)
under ``--out``. ``throughput.py --profile-decode`` runs the same profile on the engine of a
throughput run (no second start-up).

    python benchmarks/profile_step.py --workload w1 --batch 256 --context 1100
    python benchmarks/profile_step.py --workload w2 --batch 200 --context 2000
    python benchmarks/profile_step.py --workload w2 --batch 200 --context 1000 --phase prefill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qllm.plugins.pdl import use_pdl

from workloads import commit, workload, write_config

# Kernel-name fragments -> op kind, first match wins.
OP_KINDS = [
    ("gdn", ("gdn", "gated_delta", "recurrent", "chunk_", "conv1d", "conv_")),
    ("attention", ("attn", "attention", "paged", "decode_split", "decode_merge",
                   "prefill_kernel")),
    ("moe", ("moe", "expert", "align", "topk", "sort", "router", "_slot_")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "matmul", "splitk")),
    ("sampling", ("sample", "argmax", "exponential", "softmax", "multinomial")),
]


KERNELS_REPORTED = 15  # kernels in a profile's elapsed_us_per_step_by_kernel


def op_kind(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, parts in OP_KINDS if any(p in name for p in parts)), "other")


def model_len_needed(context: int, steps: int) -> int:
    """The ``max_model_len`` that ``queue_requests`` needs."""
    return context + 4 * steps + 64


def random_prompts(batch: int, context: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randint(0, 9999) for _ in range(context)] for _ in range(batch)]


def queue_requests(engine, phase: str, batch: int, context: int, steps: int) -> None:
    """Make the engine ready for ``phase``'s units: for ``"decode"``, ``batch`` sequences of
    ``context`` random prompt tokens, prefilled so that every following step decodes; for
    ``"prefill"``, one unit run as a warm-up."""
    from qllm import SamplingParams

    if phase == "prefill":
        prefill_unit(engine, batch, context, random.Random(1))
        return
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 16, ignore_eos=True)
    for prompt in random_prompts(batch, context, random.Random(0)):
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(len(s) == s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()


def decode_unit(engine) -> int:
    """One engine step of the running batch; returns the tokens it computes."""
    tokens = len(engine.scheduler.running)
    engine.step()
    return tokens


def prefill_unit(engine, batch: int, context: int, rng: random.Random) -> int:
    """Prefill ``batch`` fresh random prompts of ``context`` tokens to their first token (no
    prefix-cache hits: the tokens are new); returns the prompt tokens computed."""
    from qllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for prompt in random_prompts(batch, context, rng):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return batch * context


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every GPU kernel the profiler saw."""
    out = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us():
            out.append((event.time_range.start, event.time_range.end, event.name))
    return sorted(out)


def busy_and_gaps(intervals) -> tuple[float, float, int]:
    """Union of kernel time, total idle time between kernels, number of gaps > 5 us."""
    busy, idle, gaps, end = 0.0, 0.0, 0, None
    for start, stop, _ in intervals:
        if end is None or start >= end:
            if end is not None:
                idle += start - end
                gaps += start - end > 5
            busy += stop - start
            end = stop
        elif stop > end:  # overlaps the previous kernels
            busy += stop - end
            end = stop
    return busy, idle, gaps


def elapsed_by_kind(intervals, key=op_kind) -> dict[str, float]:
    """Each kernel charged with how far it moves the stream's end (us): from the latest end
    of the kernels before it (so an idle gap before it is its charge too; the first kernel:
    from its own start) to its end, nothing where it ends inside them. Unlike kernel
    durations, which overlap under programmatic dependent launch (a kernel waiting for the one
    before counts the wait), the charges add up to the profiled span: what each op kind costs
    the step's wall time. ``key``: what a kernel's name is charged to (its op kind)."""
    charged: dict[str, float] = {}
    frontier = None
    for start, end, name in intervals:
        advance = end - (start if frontier is None else frontier)
        if advance > 0:
            kind = key(name)
            charged[kind] = charged.get(kind, 0.0) + advance
            frontier = end
    return charged


def elapsed_by_kernel(intervals, steps: int, most: int = KERNELS_REPORTED) -> dict[str, list]:
    """The ``most`` kernels that cost a unit the most wall time: name (cut to 60 characters)
    -> ``[us per unit, launches per unit]`` (``elapsed_by_kind``'s charges), largest first.
    Under programmatic dependent launch it splits an op kind's time between its kernels (the
    MoE's router, gate-up and down), where their durations overlap."""
    charged = elapsed_by_kind(intervals, key=lambda name: name[:60])
    launches: dict[str, int] = {}
    for _, _, name in intervals:
        launches[name[:60]] = launches.get(name[:60], 0) + 1
    ranked = sorted(charged.items(), key=lambda item: -item[1])[:most]
    return {name: [round(us / steps, 1), round(launches[name] / steps, 2)]
            for name, us in ranked}


def write_sequence(path: str, intervals, kernels_per_step: int) -> None:
    """The last ``kernels_per_step`` kernels, one line each: ``duration_us gap_us kind name``."""
    last = intervals[len(intervals) - kernels_per_step:]  # not [-0:], the whole list
    with open(path, "w") as f:
        f.write(f"{'us':>8} {'gap_us':>7}  {'kind':<9} kernel\n")
        previous_end = None
        for start, end, name in last:
            gap = start - previous_end if previous_end is not None else 0.0
            f.write(f"{end - start:8.1f} {gap:7.1f}  {op_kind(name):<9} {name[:140]}\n")
            previous_end = end


def profile_steps(engine, tag: str, steps: int, out: str, unit=None) -> dict:
    """Time ``steps`` units (``unit()`` runs one and returns the tokens it computed; by default
    one decode step), then profile ``steps`` more; write the trace, the kernel table and the
    last unit's kernel sequence under ``out`` (file names carry ``tag``), print the table, and
    return the figures per unit (``step_ms``, kernels, GPU busy and idle, kernel time per op
    kind, and ``pdl``: whether the unit's kernels launch with programmatic dependent launch, in
    which case each kernel's time includes its wait for the one before, so the per-kernel and
    per-kind times overstate; ``QLLM_PDL=0`` gives them without; the elapsed time per op kind,
    ``elapsed_by_kind``, adds up to the span either way)."""

    unit = unit or (lambda: decode_unit(engine))
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(unit() for _ in range(steps))
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    tokens_per_step = tokens / steps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            unit()
        torch.cuda.synchronize()
    os.makedirs(out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out, f"trace-{tag}.json"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(os.path.join(out, f"kernels-{tag}.txt"), "w") as f:
        f.write(table)
    print(table)
    intervals = kernel_intervals(prof)
    kernels_per_step = len(intervals) // steps
    write_sequence(os.path.join(out, f"sequence-{tag}.txt"), intervals, kernels_per_step)
    busy, idle, gaps = busy_and_gaps(intervals)
    by_kind: dict[str, float] = {}
    for start_us, end_us, name in intervals:
        kind = op_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end_us - start_us)
    elapsed = elapsed_by_kind(intervals)
    return {
        "graphs": engine.runner.graphs is not None, "tokens_per_step": tokens_per_step,
        "step_ms": round(step_ms, 3), "tok_per_s": round(tokens_per_step / step_ms * 1e3, 1),
        "kernels_per_step": kernels_per_step,
        "gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
        "gpu_idle_between_kernels_ms_per_step": round(idle / steps / 1e3, 3),
        "gaps_over_5us_per_step": gaps // steps,
        "pdl": use_pdl(engine.device, round(tokens_per_step)),
        "kernel_ms_per_step_by_kind": {k: round(v / steps / 1e3, 3)
                                       for k, v in sorted(by_kind.items())},
        "elapsed_ms_per_step_by_kind": {k: round(v / steps / 1e3, 3)
                                        for k, v in sorted(elapsed.items())},
        "elapsed_us_per_step_by_kernel": elapsed_by_kernel(intervals, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["w1", "w2", "w3"], default="w1")
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1100, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--recurrent-state-dtype", default="float32",
                        help="GDN state dtype of hybrid models (float32 or bfloat16)")
    parser.add_argument("--no-prefill-graphs", action="store_true",
                        help="prefill steps run eagerly (prefill_cudagraph_token_sizes=())")
    parser.add_argument("--out", default=os.environ.get("OUT", "profile-out"))
    args = parser.parse_args()

    from qllm import LLM, SamplingParams

    config, _, _ = workload(args.workload)
    llm = LLM(write_config(config, args.num_layers), load_format="dummy", dtype="bfloat16",
              max_num_seqs=args.batch, max_model_len=model_len_needed(args.context, args.steps),
              enforce_eager=args.enforce_eager, recurrent_state_dtype=args.recurrent_state_dtype,
              **({"prefill_cudagraph_token_sizes": ()} if args.no_prefill_graphs else {}))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    queue_requests(llm.engine, args.phase, args.batch, args.context, args.steps)
    tag = f"{args.workload}-{args.phase}-b{args.batch}-ctx{args.context}"
    rng = random.Random(2)
    unit = (lambda: prefill_unit(llm.engine, args.batch, args.context, rng)) \
        if args.phase == "prefill" else None
    figures = profile_steps(llm.engine, tag, args.steps, args.out, unit)
    print(json.dumps({
        "workload": args.workload, "phase": args.phase, "batch": args.batch,
        "context": args.context, "num_layers": args.num_layers,
        "recurrent_state_dtype": args.recurrent_state_dtype,
        "prefill_graphs": llm.engine.runner.prefill_graphs is not None, **figures,
        "commit": commit(), "date": time.strftime("%Y-%m-%d")}), flush=True)


if __name__ == "__main__":
    main()
