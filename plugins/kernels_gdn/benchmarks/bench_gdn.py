"""Micro-benchmark of the Gated DeltaNet kernels against the plain-torch reference ops.

Qwen3.5-35B-A3B linear-attention geometry (16 key heads x 128, 32 value heads x 128, conv
kernel 4 over 8192 channels; hidden 2048 feeds the projections, which are not timed), bf16
activations, fp32 SSM state and bf16 conv state: decode at batch 1/16/64/200 (every sequence
with state, slots out of order) and prefill of 8 sequences x 1000 new tokens from scratch.
Implementations: ``triton`` (this plugin's kernels), ``torch`` (``qllm.ops.gdn``), and where
fla-core is installed ``fla`` (prefill: the registered chunked kernel; decode: not registered,
fla's ``fused_recurrent_gated_delta_rule`` with the slot states gathered before and scattered
after, the unfused design the in-place kernel replaces).

Times are medians of ``triton.testing.do_bench`` (L2 flushed between calls). Decode runs in
CUDA graphs in the engine, so its ``ms`` is a graph replay (``eager_ms``: plain calls, CPU
launch cost included); prefill runs eagerly. GB/s counts the bytes a call must move at least
(each state slot read and written once, inputs read, outputs written; the state is most of it
at decode) against the H200's ~4.3 TB/s. ``max_err`` is the largest difference from the torch
reference's output. Prints a table, then one JSON object per row.

    python plugins/kernels_gdn/benchmarks/bench_gdn.py \
        [--impl triton torch fla] [--batches 1 16 64 200]
        [--ssm-dtype bfloat16] [--state-layout key-major] [--slots consecutive]
        [--sweep-decode | --sweep-conv]

``--sweep-decode`` times only the Triton decode kernel over its launch configurations (value
dims per program x warps) at each batch size, to choose ``_launch_config``'s rule;
``--sweep-conv`` does the same for the conv update (channels per program x warps).
Decode sequences take slots drawn at random from 256 unless ``--slots consecutive`` gives
sequence ``i`` slot ``i``, as a freshly filled engine does (the W2 decode step's recurrent
kernel took 130 us in the engine against 113 us here with random slots). The SSM state is
stored value-major, ``[S + 1, Hv, dv, dk]`` seen by the ops as its transposed
view, as the models store it; ``--state-layout key-major`` stores it contiguous
``[S + 1, Hv, dk, dv]`` instead.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json

import torch
from triton.testing import do_bench

from qllm.ops import gdn as reference
from qllm.testing.batch import recurrent_slot_batch
from qllm.testing.benchmarking import graphed, print_table
from qllm_kernels_gdn import ops
from qllm_kernels_gdn.testing import QWEN3_5_35B_A3B, conv_inputs, gdn_inputs, random_batch

GEOMETRY = QWEN3_5_35B_A3B
DTYPE, CONV_DTYPE = torch.bfloat16, torch.bfloat16
SSM_DTYPE = torch.float32  # --ssm-dtype
KEY_MAJOR_STATE = False  # --state-layout key-major
CONSECUTIVE_SLOTS = False  # --slots consecutive
NUM_SLOTS = 256
PEAK_GBPS = 4300.0
PREFILL_SEQS, PREFILL_LEN = 8, 1000
HAS_FLA = importlib.util.find_spec("fla") is not None


def fla_decode(q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
    """Decode through fla's fused recurrent kernel: the gates in torch, gather the slots, run,
    scatter back."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    g, beta = reference.gdn_gates(a, b, A_log, dt_bias)  # [B, Hv] fp32 each
    cache = batch.caches["recurrent_slot"]
    slots = cache.slots
    initial = torch.where(cache.has_initial_state[:, None, None, None],
                          ssm_state[slots].float(), 0.0)  # [B, Hv, dk, dv]
    out, final = fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None].to(v.dtype),
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
    return out[:, 0]


IMPLS = {
    "conv_update": {"triton": ops.causal_conv1d_update,
                    "torch": reference.causal_conv1d_update},
    "conv_prefill": {"triton": ops.causal_conv1d_prefill,
                     "torch": reference.causal_conv1d_prefill},
    "gdn_decode": {"triton": ops.gdn_decode, "torch": reference.gdn_decode, "fla": fla_decode},
    "gdn_prefill": {"triton": ops.gdn_prefill, "torch": reference.gdn_prefill,
                    "fla": ops.fla_gdn_prefill},
}


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def case_args(kind: str, batch) -> tuple[tuple, torch.Tensor, int]:
    """Arguments of one call, the state it updates in place, and the bytes it must move:
    slots read and written once, inputs read, output (the size of ``x`` / ``v``) written."""
    slots = batch.caches["recurrent_slot"].slots
    if kind.startswith("conv"):
        x = conv_inputs(batch, GEOMETRY, NUM_SLOTS, DTYPE, CONV_DTYPE)
        args = (x.x, x.weight, x.conv_state, batch)
        if kind == "conv_prefill":  # its output split as the layer splits it: q, k, v
            key_dim = GEOMETRY.num_k_heads * GEOMETRY.head_k_dim
            args += ([key_dim, key_dim, GEOMETRY.num_v_heads * GEOMETRY.head_v_dim],)
        return args, x.conv_state, (2 * _nbytes(x.conv_state[slots]) + 2 * _nbytes(x.x)
                                    + _nbytes(x.weight))
    x = gdn_inputs(batch, GEOMETRY, NUM_SLOTS, DTYPE, SSM_DTYPE,
                   contiguous_state=KEY_MAJOR_STATE)
    return x.args(), x.ssm_state, (2 * _nbytes(x.ssm_state[slots])
                                   + _nbytes(x.q, x.k, x.a, x.b) + 2 * _nbytes(x.v))


def decode_batch(batch_size: int):
    """One token per sequence, every sequence with state, in random or consecutive slots."""
    if CONSECUTIVE_SLOTS:
        return recurrent_slot_batch([1] * batch_size, list(range(batch_size)),
                                    [True] * batch_size, device="cuda")
    return random_batch([1] * batch_size, NUM_SLOTS, True, device="cuda", seed=batch_size)


def measure(kind: str, name: str, batch, impls: list[str]) -> list[dict]:
    """Rows of ``impls`` on one case. The torch reference runs first (timed only if asked
    for): its output is what ``max_err`` compares against."""
    args, state, nbytes = case_args(kind, batch)
    initial_state = state.clone()
    expected = None
    rows = []
    for impl in ["torch", *(i for i in impls if i != "torch" and i in IMPLS[kind])]:
        fn = IMPLS[kind][impl]
        state.copy_(initial_state)  # every implementation starts from one state
        call = functools.partial(fn, *args)
        row = dict(kind=kind, case=name, impl=impl, batch=batch.num_seqs,
                   tokens=sum(batch.query_lens_host))
        try:
            out = call()
            if isinstance(out, (list, tuple)):  # the prefill conv's q, k, v
                out = torch.cat(out, dim=-1)
            if impl == "torch":
                expected = out.float()
                if impl not in impls:
                    continue
            eager_ms = do_bench(call, return_mode="median")
            ms = do_bench(graphed(call), return_mode="median") if kind.endswith(
                ("update", "decode")) else eager_ms
        except Exception as error:  # noqa: BLE001 - one failing implementation keeps the table
            rows.append({**row, "error": f"{type(error).__name__}: {error}"[:200]})
            continue
        gbps = nbytes / ms / 1e6
        rows.append({**row, "ms": round(ms, 4), "eager_ms": round(eager_ms, 4),
                     "gbps": round(gbps, 1), "pct_peak_bw": round(100 * gbps / PEAK_GBPS, 1),
                     "mtok_s": round(row["tokens"] / ms / 1e3, 2),
                     "max_err": round((out.float() - expected).abs().max().item(), 4)})
    return rows


def sweep(kind: str, batch_sizes: list[int]) -> None:
    """GB/s of a Triton decode-step kernel (``gdn_decode``: value dims per program x warps;
    ``conv_update``: channels per program x warps) for every launch configuration, one
    line each."""
    from qllm_kernels_gdn.triton_conv import conv1d_update
    from qllm_kernels_gdn.triton_recurrent import gated_delta_rule

    for batch_size in batch_sizes:
        batch = decode_batch(batch_size)
        args, _, nbytes = case_args(kind, batch)
        cache = batch.caches["recurrent_slot"]
        if kind == "gdn_decode":
            run = functools.partial(gated_delta_rule, *args[:8], cache.slots,
                                    cache.has_initial_state)
            blocks, block_arg, state_dtype = (8, 16, 32, 64, 128), "block_v", SSM_DTYPE
        else:
            x, weight, conv_state = args[:3]
            run = functools.partial(conv1d_update, x, weight, conv_state, cache.slots,
                                    cache.has_initial_state)
            blocks, block_arg, state_dtype = (128, 256, 512, 1024, 2048), "block_c", CONV_DTYPE
        for block in blocks:
            for num_warps in (1, 2, 4, 8):
                call = functools.partial(run, **{block_arg: block}, num_warps=num_warps)
                call()
                ms = do_bench(graphed(call), return_mode="median")
                print(json.dumps({"sweep": kind, "batch": batch_size,
                                  "slots": "consecutive" if CONSECUTIVE_SLOTS else "random",
                                  "state_layout": ("key-major" if KEY_MAJOR_STATE
                                                   or kind != "gdn_decode" else "value-major"),
                                  "state_dtype": str(state_dtype), block_arg: block,
                                  "num_warps": num_warps, "ms": round(ms, 4),
                                  "gbps": round(nbytes / ms / 1e6, 1)}))


def main() -> None:
    global SSM_DTYPE, KEY_MAJOR_STATE, CONSECUTIVE_SLOTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["triton", "fla", "torch"],
                        choices=["triton", "fla", "torch"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 200])
    parser.add_argument("--ssm-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--state-layout", default="value-major",
                        choices=["key-major", "value-major"])
    parser.add_argument("--slots", default="random", choices=["random", "consecutive"])
    sweeps = parser.add_mutually_exclusive_group()
    sweeps.add_argument("--sweep-decode", action="store_true")
    sweeps.add_argument("--sweep-conv", action="store_true")
    args = parser.parse_args()
    SSM_DTYPE = getattr(torch, args.ssm_dtype)
    KEY_MAJOR_STATE = args.state_layout == "key-major"
    CONSECUTIVE_SLOTS = args.slots == "consecutive"
    if args.sweep_decode or args.sweep_conv:
        sweep("gdn_decode" if args.sweep_decode else "conv_update", args.batches)
        return
    impls = [i for i in args.impl if i != "fla" or HAS_FLA]

    rows = []
    for batch_size in args.batches:
        batch = decode_batch(batch_size)
        for kind in ("conv_update", "gdn_decode"):
            rows += measure(kind, f"decode b{batch_size}", batch, impls)
    batch = random_batch([PREFILL_LEN] * PREFILL_SEQS, NUM_SLOTS, False, device="cuda")
    for kind in ("conv_prefill", "gdn_prefill"):
        rows += measure(kind, f"prefill {PREFILL_SEQS}x{PREFILL_LEN}", batch, impls)

    print_table(rows, [("kind", "op", 14, None), ("case", "case", 18, None),
                       ("impl", "impl", 8, None), ("ms", "ms", 9, ".4f"),
                       ("eager_ms", "eager_ms", 10, ".4f"), ("gbps", "GB/s", 9, ".1f"),
                       ("pct_peak_bw", "%peak", 7, ".1f"), ("mtok_s", "Mtok/s", 9, ".2f"),
                       ("max_err", "max_err", 9, ".4f"), ("error", "error", 0, None)])


if __name__ == "__main__":
    main()
