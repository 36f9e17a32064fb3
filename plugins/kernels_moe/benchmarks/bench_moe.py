"""Micro-benchmark of the Triton fused MoE against the plain-torch reference, and its tuner.

Qwen3.5-35B-A3B experts (256 routed, top-8, plus the shared expert as a ninth slot per token;
hidden 2048, expert size 512, bf16): decode at batch 1/4/16/64/200/256 and a 4096-token prefill,
routed like the model's router (top-8 of a softmax over random logits, then the shared
expert). Times are medians of ``triton.testing.do_bench`` (L2 flushed
between calls). Decode runs in CUDA graphs in the engine, so its ``ms`` is a graph replay
(``eager_ms``: plain calls, CPU launch cost included); prefill runs eagerly. ``align_ms`` is
the torch slot sort alone, ``tr_align`` the Triton align. GB/s
counts the bytes a call must move at least (the weights of every expert hit, read once, plus
x and the per-slot output) against the H200's ~4.3 TB/s; TFLOP/s counts
the three matmuls per routed slot. ``torch`` is the plain-torch reference (host-syncs, so
eager only); ``max_err`` is the largest difference from it. Prints a table, then one JSON
object per row.

``--tune`` sweeps BLOCK_M and each GEMM's BLOCK_N / BLOCK_K / GROUP_M / num_warps /
num_stages per token count (up to 16 tokens also the small-batch path: BLOCK_M 1, no sort; the
sorted path's totals count its align), checks the
winner against the reference and rewrites the shipped table
(``qllm_kernels_moe/configs/E=256,N=1024,K=2048.json``) entry by entry, so a sweep can be split
over several runs with ``--tokens`` and ``--block-m``: an entry records its time
(``tuned_ms``), and a later sweep on the same device replaces it only when faster (delete
``tuned_ms`` after a kernel change); an entry chosen end to end (``chosen_end_to_end``: how
and where) is kept and not swept (delete the field to sweep it). The full sweep takes the
better part of an hour; ``--grid quick`` tries fewer tiles; ``--grid decode`` the tiles of
weight-streaming decode batches.

``--set-entry TOKENS GEMM=BLOCK_N,BLOCK_K,num_warps,num_stages[,programs_per_sm] ...`` writes
tiles into one entry by hand (an end-to-end trial of a tile the standalone sweep did not pick;
the entry becomes untuned), printing the entry it replaced; ``persistent=PROGRAMS_PER_SM``
there runs the slot path's GEMMs in one persistent kernel, ``prefetch=1`` has its gate-up
ask the L2 cache for the down's weights.

    python plugins/kernels_moe/benchmarks/bench_moe.py [--impl triton torch]
    python plugins/kernels_moe/benchmarks/bench_moe.py \
        --tune [--grid quick|decode] [--tokens 1 2 4 8 ... 4096]
        [--block-m 1 16 32 64 128]
    python plugins/kernels_moe/benchmarks/bench_moe.py --set-entry 1 up=2,2048,4,1
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

from qllm.ops.moe import fused_moe as torch_fused_moe
from qllm.testing.benchmarking import compile_ahead, print_table, time_ms
from qllm_kernels_moe import ops
from qllm_kernels_moe.align import moe_align
from qllm_kernels_moe.configs import GemmConfig, MoeConfig, config_path, get_config, load_table
from qllm_kernels_moe.testing import MoeInputs, moe_inputs
from qllm_kernels_moe.triton_align import moe_align_triton
from qllm_kernels_moe.triton_moe import down, fused_moe_triton, gate_up
from qllm_kernels_moe.triton_slot_moe import slot_down, slot_gate_up

EXPERTS, TOP_K, HIDDEN, INTER, DTYPE = 256, 8, 2048, 512, torch.bfloat16
PEAK_GBPS = 4300.0
CASES = {"decode b1": 1, "decode b4": 4, "decode b16": 16, "decode b64": 64, "decode b200": 200,
         "decode b256": 256,
         "prefill 4096": 4096}
TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SMEM_BYTES = 227 * 1024  # per-block shared memory on H100 / H200


def traffic(inputs: MoeInputs) -> tuple[int, int]:
    """(bytes, flops) of one call: each expert hit read once, x read, the per-slot outputs
    ``[T, k, H]`` written; three matmuls (gate, up, down) per slot, the shared expert's
    included."""
    expert_params = 3 * INTER * HIDDEN
    experts_hit = inputs.topk_ids.unique().numel()
    slots = inputs.topk_ids.shape[1]
    nbytes = (experts_hit * expert_params + (1 + slots) * inputs.x.numel()) \
        * inputs.x.element_size()
    return nbytes, 2 * inputs.topk_ids.numel() * expert_params


def measure(name: str, tokens: int, impls: list[str]) -> list[dict]:
    inputs = moe_inputs(tokens, EXPERTS, HIDDEN, INTER, TOP_K, DTYPE, "cuda")
    nbytes, flops = traffic(inputs)
    graph = name.startswith("decode")
    reference = torch_fused_moe(*inputs)
    rows = []
    for impl in impls:
        fn = ops.fused_moe if impl == "triton" else torch_fused_moe
        out = fn(*inputs)
        eager_ms = time_ms(lambda: fn(*inputs), graph=False)
        ms = eager_ms
        align_ms = triton_align_ms = None
        if impl == "triton":
            ms = time_ms(lambda: fn(*inputs), graph=True) if graph else eager_ms
            block_m = get_config(tokens, EXPERTS, 2 * INTER, HIDDEN, TOP_K).BLOCK_M
            align_ms = round(time_ms(lambda: moe_align(inputs.topk_ids, EXPERTS + 1, block_m),
                                     graph), 4)
            triton_align_ms = round(time_ms(
                lambda: moe_align_triton(inputs.topk_ids, EXPERTS + 1, block_m), graph), 4)
        gbps = nbytes / ms / 1e6
        rows.append(dict(case=name, impl=impl, tokens=tokens, ms=round(ms, 4),
                         eager_ms=round(eager_ms, 4), align_ms=align_ms,
                         triton_align_ms=triton_align_ms, gbps=round(gbps, 1),
                         pct_peak_bw=round(100 * gbps / PEAK_GBPS, 1),
                         tflops=round(flops / ms / 1e9, 1),
                         max_err=round((out.float() - reference.float()).abs().max().item(),
                                       4)))
    return rows


COLUMNS = [("case", "case", 16, None), ("impl", "impl", 8, None), ("ms", "ms", 9, ".4f"),
           ("eager_ms", "eager_ms", 10, ".4f"), ("align_ms", "align_ms", 10, ".4f"),
           ("triton_align_ms", "tr_align", 10, ".4f"), ("gbps", "GB/s", 9, ".1f"),
           ("pct_peak_bw", "%peak", 7, ".1f"), ("tflops", "TFLOP/s", 9, ".1f"),
           ("max_err", "max_err", 9, ".4f")]


# ----------------------------------------------------------------------------- tuning

# Tile grids of the sweep: "full" (the better part of an hour for every token count), "quick"
# (a minute or two per token count, for a short GPU session) and "decode" (a few minutes per
# BLOCK_M: the longer K tiles, deeper pipelines and narrower N tiles that "quick" leaves out,
# for decode batches, where the expert GEMMs stream weights: W2's ran at 4.1-4.2 TB/s with the
# quick grid's pick).
GRIDS = {
    "full": dict(n_gated=(16, 32, 64, 128), n=(32, 64, 128, 256), k=(64, 128, 256),
                 warps=(4, 8), stages=(2, 3, 4, 5)),
    "quick": dict(n_gated=(32, 64, 128), n=(64, 128, 256), k=(64, 128), warps=(4, 8),
                  stages=(3, 4)),
    "decode": dict(n_gated=(16, 32, 64), n=(32, 64, 128), k=(128, 256), warps=(2, 4),
                   stages=(3, 4, 5)),
}


def gemm_candidates(block_m: int, gated: bool, many_blocks_per_expert: bool, grid: dict):
    """Tiles for one GEMM that fit in shared memory (gated: two weight tiles per stage)."""
    block_ns = grid["n_gated"] if gated else grid["n"]
    group_ms = (1, 8) if many_blocks_per_expert else (1,)
    for n, k, group, warps, stages in itertools.product(
            block_ns, grid["k"], group_ms, grid["warps"], grid["stages"]):
        smem = stages * (block_m * k + (2 if gated else 1) * k * n) * DTYPE.itemsize
        if smem <= SMEM_BYTES:
            yield GemmConfig(n, k, group, warps, stages)


# The small-batch path (BLOCK_M 1): rows per program, the K tile each row streams, warps and
# loop stages; tried up to SLOT_PATH_TUNE_TOKENS tokens. A K tile of 2,048 covers the gate-up's
# whole hidden size in one step (every weight load of a program in flight at once).
SLOT_GRID = dict(n=(1, 2, 4, 8, 16, 32), k=(256, 512, 1024, 2048), warps=(1, 2, 4, 8),
                 stages=(1, 2))
SLOT_PATH_TUNE_TOKENS = 16
SLOT_TILE_ELEMENTS = 16384  # fp32 accumulator elements per program, at most
SLOT_THREAD_ELEMENTS = 128  # and per thread (the gated GEMM holds two such tiles)


def slot_candidates():
    """Tiles of the small-batch path's GEMVs whose fp32 accumulators stay in registers."""
    for n, k, warps, stages in itertools.product(*SLOT_GRID.values()):
        if n * k <= min(SLOT_TILE_ELEMENTS, SLOT_THREAD_ELEMENTS * 32 * warps):
            yield GemmConfig(n, k, 1, warps, stages)


def tune_slot_path(inputs: MoeInputs) -> tuple[float, MoeConfig]:
    """The fastest small-batch config (its two GEMVs) for ``inputs``, and its time in ms."""
    x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2 = inputs
    up_ms, up = best_gemm(lambda c: slot_gate_up(x, w13, shared_w13, topk_ids, c),
                          slot_candidates(), graph=True)
    hidden = slot_gate_up(x, w13, shared_w13, topk_ids, up)
    down_ms, dn = best_gemm(
        lambda c: slot_down(hidden, w2, shared_w2, topk_weights, topk_ids, c),
        slot_candidates(), graph=True)
    total = up_ms + down_ms
    print(f"  T={x.shape[0]} BLOCK_M=1: up {up_ms:.4f} + down {down_ms:.4f} = {total:.4f} ms",
          flush=True)
    return total, MoeConfig(1, up, dn)


def best_gemm(run, candidates, graph: bool) -> tuple[float, GemmConfig]:
    """The fastest candidate of ``run(config)`` (all compiled first, in parallel); candidates
    that fail to compile are skipped."""
    candidates = list(candidates)
    compile_ahead([lambda config=config: run(config) for config in candidates])
    best = (float("inf"), None)
    for config in candidates:
        try:
            ms = time_ms(lambda: run(config), graph, rep=25)
        except triton.runtime.errors.OutOfResources:
            continue
        best = min(best, (ms, config), key=lambda pair: pair[0])
    return best


BLOCK_MS = (1, 16, 32, 64, 128)  # 1: the small-batch path


def tune_tokens(tokens: int, grid: dict, block_ms: tuple[int, ...] = BLOCK_MS
                ) -> tuple[MoeConfig, float]:
    """The fastest config for ``tokens`` tokens among ``block_ms`` (sort and both GEMMs, or
    the small-batch path's two GEMVs), and its time in ms."""
    inputs = moe_inputs(tokens, EXPERTS, HIDDEN, INTER, TOP_K, DTYPE, "cuda")
    x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2 = inputs
    graph = tokens <= 256
    slots_per_expert = tokens * TOP_K / EXPERTS
    best = (float("inf"), None)
    if 1 in block_ms and tokens <= SLOT_PATH_TUNE_TOKENS:
        best = tune_slot_path(inputs)
    for block_m in (m for m in block_ms if m > 1):
        # blocks mostly padding for every expert are not worth timing; the shared expert has a
        # slot per token, so blocks up to the token count may pay for it
        if block_m > max(16, tokens) and block_m > 2 * slots_per_expert:
            continue
        # grouped launch orders pay where an expert spans several blocks: the shared expert
        # (one slot per token) does once the tokens outnumber a block
        many = tokens > block_m
        sorted_slots = moe_align_triton(topk_ids, EXPERTS + 1, block_m)
        align_ms = time_ms(lambda: moe_align_triton(topk_ids, EXPERTS + 1, block_m), graph)
        up_ms, up = best_gemm(
            lambda c: gate_up(x, w13, shared_w13, sorted_slots, TOP_K + 1, block_m, c),
            gemm_candidates(block_m, True, many, grid), graph)
        hidden = gate_up(x, w13, shared_w13, sorted_slots, TOP_K + 1, block_m, up)
        down_ms, dn = best_gemm(
            lambda c: down(hidden, w2, shared_w2, topk_weights, sorted_slots, block_m, c),
            gemm_candidates(block_m, False, many, grid), graph)
        total = align_ms + up_ms + down_ms
        print(f"  T={tokens} BLOCK_M={block_m}: align {align_ms:.4f} + up {up_ms:.4f} "
              f"+ down {down_ms:.4f} = {total:.4f} ms", flush=True)
        best = min(best, (total, MoeConfig(block_m, up, dn)), key=lambda pair: pair[0])
    total, config = best
    if config is None:
        raise ValueError(f"no BLOCK_M among {block_ms} to time at {tokens} tokens (the "
                         f"small-batch path runs up to {SLOT_PATH_TUNE_TOKENS})")
    reference = torch_fused_moe(x.float(), w13.float(), w2.float(), topk_weights.float(),
                                topk_ids, shared_w13.float(), shared_w2.float())
    torch.testing.assert_close(fused_moe_triton(*inputs, config=config).float(), reference,
                               atol=2e-2, rtol=2e-2)
    return config, total


def write_table(path: Path, meta: dict, entries: dict[int, dict]) -> None:
    """The table as JSON, one entry per line."""
    lines = ["{"] + [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in meta.items()]
    lines.append('  "configs": {')
    items = [f"    {json.dumps(str(key))}: {json.dumps(entries[key])}" for key in sorted(entries)]
    lines += [",\n".join(items), "  }", "}"]
    path.write_text("\n".join(lines) + "\n")


def read_table(path: Path) -> tuple[dict, dict[int, dict]]:
    """The table at ``path`` as ``(its other fields, {tokens: entry})`` (``write_table``'s
    arguments)."""
    document = json.loads(path.read_text())
    return document, {int(key): value for key, value in document.pop("configs").items()}


TILE_FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "programs_per_sm")


def parse_tile(spec: str) -> tuple[str, dict | int]:
    """``GEMM=BLOCK_N,BLOCK_K,num_warps,num_stages[,programs_per_sm]`` (GEMM ``up`` or
    ``down``) -> ``(GEMM, those fields)``; ``persistent=PROGRAMS_PER_SM`` (the slot path's
    both GEMMs in one persistent kernel; 0: two kernels) -> ``("persistent_programs_per_sm",
    that count)``; ``prefetch=1`` (or 0) -> ``("prefetch_down", True)``: the slot gate-up asks
    L2 for the down's weights."""
    gemm, _, values = spec.partition("=")
    if gemm == "persistent" and values.isdigit():
        return "persistent_programs_per_sm", int(values)
    if gemm == "prefetch" and values in ("0", "1"):
        return "prefetch_down", values == "1"
    fields = values.split(",")
    if (gemm not in ("up", "down") or len(fields) not in (4, 5)
            or not all(f.isdigit() for f in fields)):
        raise ValueError(f"tile {spec!r}: expected up=... or down=... with BLOCK_N,BLOCK_K,"
                         f"num_warps,num_stages and optionally programs_per_sm, e.g. "
                         f"up=2,2048,4,1 or up=1,2048,4,1,4, persistent=PROGRAMS_PER_SM or "
                         f"prefetch=1")
    return gemm, dict(zip(TILE_FIELDS, map(int, fields)))


def set_entry(tokens: int, tiles: list[str], path: Path) -> dict:
    """Write ``tiles`` (``parse_tile`` specs) into the entry for ``tokens`` of the table at
    ``path``, its other fields kept and its record of how it was chosen (tuned or end to end)
    dropped; returns the entry replaced."""
    document, entries = read_table(path)
    if tokens not in entries:
        raise ValueError(f"{path.name} has no entry for {tokens} tokens: {sorted(entries)}")
    replaced = entries[tokens]
    entry = {key: value for key, value in replaced.items()
             if key not in ("tuned_ms", "chosen_end_to_end")}
    entry["tuned_on"] = None
    for field, value in map(parse_tile, tiles):
        entry[field] = {**entry[field], **value} if isinstance(value, dict) else value
    entries[tokens] = entry
    write_table(path, document, entries)
    return replaced


def tune(token_counts: list[int], grid: dict, block_ms: tuple[int, ...] = BLOCK_MS) -> None:
    path = config_path(EXPERTS, 2 * INTER, HIDDEN)
    document, entries = read_table(path)
    device = torch.cuda.get_device_name()
    for tokens in token_counts:
        kept = entries.get(tokens, {})
        if kept.get("chosen_end_to_end"):  # the op alone does not see what chose it: no sweep
            print(f"T={tokens}: kept the entry chosen end to end "
                  f"({kept['chosen_end_to_end']})", flush=True)
            continue
        config, ms = tune_tokens(tokens, grid, block_ms)
        if kept.get("tuned_on") == device and kept.get("tuned_ms", float("inf")) <= ms:
            # a sweep over other BLOCK_M values found something faster before
            print(f"T={tokens}: {ms:.4f} ms with {config}; kept the entry's "
                  f"{kept['tuned_ms']:.4f} ms", flush=True)
            continue
        entries[tokens] = {**config.to_json(), "tuned_on": device, "tuned_ms": round(ms, 4)}
        write_table(path, document, entries)
        print(f"T={tokens}: {ms:.4f} ms with {config} -> {path.name}", flush=True)
    load_table.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["triton", "torch"],
                        choices=["triton", "torch"])
    parser.add_argument("--tune", action="store_true", help="sweep configs, rewrite the table")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TUNE_TOKENS),
                        help="token counts to tune (with --tune)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full",
                        help="tile grid of the sweep (with --tune)")
    parser.add_argument("--block-m", nargs="+", type=int, default=list(BLOCK_MS),
                        choices=BLOCK_MS, help="BLOCK_M values to try (with --tune; 1: the "
                        "small-batch path); an entry tuned faster on this device is kept")
    parser.add_argument("--set-entry", nargs="+", metavar="TOKENS GEMM=TILE",
                        help="write tiles into the table's entry for TOKENS, e.g. 1 "
                        "up=2,2048,4,1 (BLOCK_N,BLOCK_K,num_warps,num_stages)")
    args = parser.parse_args()
    if args.set_entry:
        tokens, *tiles = args.set_entry
        path = config_path(EXPERTS, 2 * INTER, HIDDEN)
        print(json.dumps({"replaced": set_entry(int(tokens), tiles, path)}))
        return
    if args.tune:
        tune(args.tokens, GRIDS[args.grid], tuple(args.block_m))
        return
    rows = []
    for name, tokens in CASES.items():
        rows += measure(name, tokens, args.impl)
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
