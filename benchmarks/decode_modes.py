"""Decode through today's path against whole-model ``torch.compile(mode="reduce-overhead")``,
on one engine at a workload's geometry (random weights, ``load_format="dummy"``), in one
process.

    python benchmarks/decode_modes.py --workload w3 --batch 1 --context 512
    python benchmarks/decode_modes.py --workload w2 --batch 200 --context 2000
    python benchmarks/decode_modes.py --workload w1 --batch 256 --context 1100

``today``: the engine as the workloads build it, less the start-up warm-up (prefill kernels
for a ladder of step sizes: the same for both modes). Its decoder layers are compiled one by
one (symbolic batch) and whole decode steps are captured as CUDA graphs per padded batch
bucket at start-up. Reported: the start-up split (``LLMEngine.startup``), steady
``engine.step`` time (scheduling, sampling and async overlap included) and the time of one
step's graph replay alone.

``reduce_overhead``: the runner's decode forward (``ModelRunner.decode_logits``: every layer
and the LM head) compiled as one graph, ``torch.compile(mode="reduce-overhead",
dynamic=True, fullgraph=True)``, Inductor recording and replaying its own CUDA graphs (CUDA
graph trees), on the same model, cache and inputs. Reported: its first call (trace, compile
or cache load, one run outside a graph), its second (the CUDA graph's recording), steady
calls, torch's compile-cache lookups and Inductor's CUDA-graph skips (0 on CUDA, or the
steady figure is not of a graph). ``dynamic=True``, as the layers are compiled today: one
compile serves every batch bucket, each recording its own graph (a batch of 1 is
specialised, one compile more: W3's batch of 1 measures that one, W2's 200 the symbolic one);
``--static-shapes`` compiles for the measured batch alone, which an engine would repeat per
bucket.

Both run one fixed decode step of ``--batch`` sequences of ``--context`` prefilled tokens,
prepared by the runner in the fixed layout of its CUDA-graph bucket, so they do the same
work. The logits check runs both from the same cache contents (``SavedState``): today's step,
the state put back, and reduce-overhead's step. ``rerun_max_abs_diff`` reruns today's step
after putting the state back: 0 shows that the two start from identical contents.

Prints one JSON line (and the ``today`` figures to stderr first, in case the compile runs out
of time). Run it twice on one ``QLLM_CACHE_DIR``, empty at first, for the cold and the warm
start-up; each mode's ``compile_cache`` says which it saw. On the CPU (a smoke test: the
times mean nothing, and nothing is recorded as a CUDA graph) each bucket's "graph" reruns the
step (``qllm.testing.with_decode_graphs``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch._dynamo.utils import counters

import profile_step
from qllm import LLM
from qllm.engine.startup import compile_seconds_so_far
from qllm.runner import compile_cache
from qllm.testing import with_decode_graphs
from workloads import commit, workload, write_config


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(call, steps: int, device: torch.device) -> float:
    """Mean wall ms per call of ``steps`` back-to-back calls, the device's work included."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def fixed_step(engine):
    """The next decode step of every running sequence: ``(graph shape, (input_ids [B],
    positions [B], batch))``, prepared in its bucket's fixed layout, its pending input tokens
    taken from the step in flight. Scheduled but never launched: the engine is not stepped
    again, both modes rerun this step."""
    scheduled = engine.scheduler.schedule()
    assert scheduled is not None and not scheduled.is_prefill, scheduled
    graph = engine.runner.graph_shape(scheduled)
    assert graph is not None, f"no decode graph holds {len(scheduled)} sequences"
    return graph, engine.runner.prepare(scheduled, graph, fixed_layout=True,
                                        previous=engine._in_flight)


class SavedState:
    """A copy of the recurrent-state rows (conv and SSM state of every linear-attention
    layer) of a step's slots, which the step reads and rewrites in place, so that the step
    can rerun from the same state. The paged KV cache needs no copy: a decode step writes
    only its new token's K/V, before reading it, so a rerun overwrites what the run before
    it wrote and reads the same context."""

    def __init__(self, engine, batch):
        pool = engine.cache.pools.get("recurrent_slot")
        if pool is None:  # a model without recurrent layers
            self.saved = []
            return
        slots = batch.caches["recurrent_slot"].slots  # [B]
        self.saved = [(tensor, slots, tensor[slots].clone()) for tensor in pool.storage]

    def restore(self) -> None:
        for tensor, slots, saved in self.saved:
            tensor[slots] = saved


def agreement(got: torch.Tensor, expected: torch.Tensor) -> dict:
    """How close logits ``got`` are to ``expected`` (both ``[B, V]``): the least row cosine,
    the largest absolute difference, and the share of rows with the same argmax."""
    got, expected = got.float(), expected.float()
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)  # [B]
    return {"cosine_min": round(cosine.min().item(), 6),
            "max_abs_diff": round((got - expected).abs().max().item(), 6),
            "argmax_equal": (got.argmax(-1) == expected.argmax(-1)).float().mean().item()}


def reduce_overhead(runner, dynamic: bool):
    """``runner.decode_logits`` compiled whole with Inductor's CUDA graphs; each call starts a
    new step (a call's logits are overwritten by the next: clone what is kept)."""
    compiled = torch.compile(runner.decode_logits, mode="reduce-overhead", dynamic=dynamic,
                             fullgraph=True)

    def call(input_ids, positions, batch):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(input_ids, positions, batch)

    return call


def timed_first_calls(call, device: torch.device, cache) -> dict:
    """Seconds of ``call``'s first two calls (compile, then the CUDA graph's recording), the
    torch.compile seconds within them, and what the compile cache served."""
    lookups, entries = compile_cache.lookups(), cache.triton_entries()
    compiled, skips = compile_seconds_so_far(), counters["inductor"]["cudagraph_skips"]
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        call()
        synchronize(device)
        seconds.append(round(time.perf_counter() - start, 2))
    seen = compile_cache.lookups_since(lookups)
    after = cache.triton_entries()
    return {"first_call_seconds": seconds[0], "second_call_seconds": seconds[1],
            "compile_seconds": None if compiled is None
            else round(compile_seconds_so_far() - compiled, 2),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
            "compile_cache": {"state": compile_cache.cache_state(seen) if cache.enabled
                              else "off", "lookups": seen,
                              "new_triton_entries": None if after is None else after - entries}}


@torch.inference_mode()
def measure(llm, batch: int, context: int, steps: int, dynamic: bool = True) -> dict:
    """Both decode modes on ``llm``'s engine (idle, with a decode graph holding ``batch``
    sequences and room for ``profile_step.model_len_needed(context, steps)`` tokens each):
    steady step ms and tokens/s, reduce-overhead's first calls, and the agreement of their
    logits on one step from the same cache contents."""
    engine = llm.engine
    device = engine.device
    profile_step.queue_requests(engine, "decode", batch, context, steps)
    engine_step_ms = timed_ms(engine.step, steps, device)
    graph, inputs = fixed_step(engine)
    state = SavedState(engine, inputs[2])

    def today():
        return engine.runner.replay(graph, *inputs)[:batch]  # [B, V], inert rows dropped

    expected = today().clone()
    state.restore()
    rerun = today().clone()
    today_ms = timed_ms(today, steps, device)
    figures = {"today": {"engine_step_ms": round(engine_step_ms, 3),
                         "step_ms": round(today_ms, 3),
                         "tok_per_s": round(batch / today_ms * 1e3, 1),
                         "graph_batch": graph.size}}
    print(json.dumps(figures), file=sys.stderr, flush=True)

    compiled = reduce_overhead(engine.runner, dynamic)
    first = timed_first_calls(lambda: compiled(*inputs), device, engine.startup.cache)
    ro_ms = timed_ms(lambda: compiled(*inputs), steps, device)
    state.restore()
    got = compiled(*inputs)[:batch].clone()
    figures["reduce_overhead"] = {"step_ms": round(ro_ms, 3),
                                  "tok_per_s": round(batch / ro_ms * 1e3, 1), **first,
                                  "dynamic": dynamic}
    figures["agreement"] = {**agreement(got, expected),
                            "rerun_max_abs_diff": (rerun - expected).abs().max().item()}
    figures["steady_speedup"] = round(today_ms / ro_ms, 3)  # > 1: reduce-overhead is faster
    return figures


def build_engine(args):
    """The workload's engine at ``args.batch`` sequences of up to ``--context`` prompt tokens
    and the steps timed, as ``profile_step.py`` builds it, without the start-up warm-up. On
    the CPU the decode layers are compiled too, and each bucket's graph reruns the step."""
    config, _, _ = workload(args.workload)
    llm = LLM(write_config(config, args.num_layers), load_format="dummy", dtype="bfloat16",
              max_num_seqs=args.batch,
              max_model_len=profile_step.model_len_needed(args.context, args.steps),
              recurrent_state_dtype=args.recurrent_state_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, warm_up=False,
              compile_on_cpu=True)
    if llm.engine.runner.graphs is None:
        with_decode_graphs(llm, llm.engine.runner.decode_graph_sizes())
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["w1", "w2", "w3"], default="w3")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="steady steps timed per mode")
    parser.add_argument("--num-layers", type=int, help="fewer layers than the real model")
    parser.add_argument("--recurrent-state-dtype", default="float32",
                        help="GDN state dtype of hybrid models (float32 or bfloat16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="below the engine's 0.9: room for reduce-overhead's own graph "
                             "memory and the copy of the batch's recurrent state")
    parser.add_argument("--static-shapes", action="store_true",
                        help="compile reduce-overhead with dynamic=False (for this batch only)")
    args = parser.parse_args()

    start = time.perf_counter()
    llm = build_engine(args)
    startup_seconds = time.perf_counter() - start
    startup = llm.engine.startup.summary()
    graphs = llm.engine.runner.graphs
    figures = measure(llm, args.batch, args.context, args.steps, not args.static_shapes)
    figures["today"].update(startup_seconds=round(startup_seconds, 1), startup=startup,
                            decode_graph_sizes=graphs.sizes)
    cuda = llm.engine.device.type == "cuda"
    print(json.dumps({
        "workload": args.workload, "batch": args.batch, "context": args.context,
        "steps": args.steps, "num_layers": args.num_layers,
        "recurrent_state_dtype": args.recurrent_state_dtype, **figures,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "commit": commit(), "date": time.strftime("%Y-%m-%d")}), flush=True)


if __name__ == "__main__":
    main()
