"""How many Triton kernel variants the decode graphs' capture compiles: the decode step's
kernel-plugin launches of one Qwen3.5-35B-A3B layer of each kind (Gated DeltaNet + MoE, gated
attention + MoE) at every decode bucket up to ``--max-num-seqs``, captured instead of run on
``meta`` tensors (``qllm.testing.sm90.captured_launches``; no GPU needed), then grouped as
Triton keys its compiles: the constants, each integer argument equal to 1, divisible by 16 or
neither, the launch options, PDL on up to ``PDL_MAX_ROWS`` rows as on an H200. With
``--compile`` each variant is compiled for sm_90 on this machine and its seconds summed per
kernel (a cold capture compiles them one after another; ``QLLM_COMPILE_AHEAD=1`` in threads).

The calls follow the layers' shapes (transformers' ``Qwen3_5MoeTextConfig`` defaults, bf16);
where a layer passes a strided view of a packed projection, the tensor here is contiguous:
both strides are multiples of 16 elements, so the specializations match. Prints one line per
kernel, then the total, then one JSON line.

    python benchmarks/graph_specializations.py [--max-num-seqs 200] [--compile]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from unittest import mock

import torch

from qllm.config import EngineConfig
from qllm.plugins import pdl
from qllm.testing.sm90 import KernelLaunch, captured_launches, compile_for_sm90, specialize

BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
SLOTS, PAGES, PAGE = 256, 4096, 256  # recurrent-state slots, KV pages and their tokens
ROTARY_POSITIONS = 4096


def meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def decode_calls(batch: int, c) -> dict:
    """The kernel plugins' launchers as a decode step of ``batch`` sequences calls them, per
    op, for config ``c``."""
    from qllm_kernels_attention.triton_decode import decode_attention
    from qllm_kernels_attention.triton_qk_norm_rope import qk_norm_rope_kv_store
    from qllm_kernels_gdn.triton_conv import conv1d_update
    from qllm_kernels_gdn.triton_recurrent import decode_gated_norm
    from qllm_kernels_linear.configs import serves
    from qllm_kernels_linear.triton_gemv import gemv
    from qllm_kernels_linear.triton_norm import add_rms_norm
    from qllm_kernels_moe.triton_moe import fused_moe_triton
    from qllm_kernels_moe.triton_router import moe_router_triton

    b, h, e, k = batch, c.hidden_size, c.num_experts, c.num_experts_per_tok
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    conv = 2 * hk * dk + hv * dv
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rotary = int(d * c.rope_parameters.get("partial_rotary_factor", 1.0))
    inter = c.moe_intermediate_size
    slots = (meta(b, dtype=I32), meta(b, dtype=torch.bool))

    kv_cache = (meta(PAGES, PAGE, hkv, d), meta(PAGES, PAGE, hkv, d))
    calls = {
        "add_rms_norm": lambda: add_rms_norm(meta(b, k + 1, h), meta(b, h), meta(h), 1e-6, True),
        "moe_router": lambda: moe_router_triton(meta(b, e + 8)[:, :e + 1], k, False),
        "fused_moe": lambda: fused_moe_triton(
            meta(b, h), meta(e, 2 * inter, h), meta(e, h, inter), meta(b, k + 1),
            meta(b, k + 1, dtype=I64), meta(2 * inter, h), meta(h, inter)),
        "causal_conv1d_update": lambda: conv1d_update(
            meta(b, conv), meta(conv, c.linear_conv_kernel_dim),
            meta(SLOTS + 1, conv, c.linear_conv_kernel_dim - 1), *slots),
        "gdn_decode_gated_norm": lambda: decode_gated_norm(
            meta(b, hk, dk), meta(b, hk, dk), meta(b, hv, dv), meta(b, hv), meta(b, hv),
            meta(hv, dtype=F32), meta(hv), meta(SLOTS + 1, hv, dv, dk).transpose(-1, -2),
            *slots, meta(b, hv, dv), meta(dv), 1e-6),
        "qk_norm_rope_kv_store": lambda: qk_norm_rope_kv_store(
            meta(b, hq, d), meta(b, hkv, d), meta(b, hkv, d), meta(d), meta(d),
            meta(ROTARY_POSITIONS, rotary, dtype=F32), meta(b, dtype=I64), 1e-6, True,
            *kv_cache, meta(b, dtype=I64)),
        "paged_attention_decode": lambda: decode_attention(  # with Qwen3.5's output gate
            meta(b, hq, d), *kv_cache, meta(b, dtype=I32), meta(b, 16, dtype=I32), d ** -0.5,
            meta(b, hq, d)),
    }
    projections = {"gdn_in_proj": (conv + hv * dv + 2 * hv, h), "gdn_out_proj": (h, hv * dv),
                   "attention_qkv": ((2 * hq + 2 * hkv) * d, h), "attention_o": (h, hq * d),
                   "moe_input": (e + 8, h)}
    for name, (n, kk) in projections.items():
        if serves(b, n, kk):  # else cuBLAS: nothing to compile
            calls[f"linear ({name})"] = lambda n=n, kk=kk: gemv(meta(b, kk), meta(n, kk))
    return calls


def specialization(launch: KernelLaunch) -> tuple:
    """What Triton keys a compile of ``launch`` by: the kernel, its specialized signature,
    constants and divisible arguments (``qllm.testing.sm90.specialize``), the launch options."""
    signature, constexprs, attrs = specialize(launch.kernel, launch.args)
    return (launch.kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()),
            tuple(attrs), tuple(sorted(launch.options.items())))


def variants(max_num_seqs: int, config) -> dict[tuple, KernelLaunch]:
    """Every distinct kernel variant the decode buckets up to ``max_num_seqs`` launch, with
    PDL where an H200 would take it (the launchers ask ``pdl_available``)."""
    sizes = [s for s in EngineConfig.cudagraph_batch_sizes if s <= max_num_seqs]
    sizes += [] if max_num_seqs in sizes else [max_num_seqs]
    found = {}
    with mock.patch.object(pdl, "pdl_available", lambda device: True):
        for batch in sizes:
            for call in decode_calls(batch, config).values():
                for launch in captured_launches(call):
                    found.setdefault(specialization(launch), launch)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=200)
    parser.add_argument("--compile", action="store_true",
                        help="compile each variant for sm_90 here and time it")
    args = parser.parse_args()
    import transformers

    found = variants(args.max_num_seqs, transformers.Qwen3_5MoeTextConfig())
    per_kernel = collections.Counter(key[0] for key in found)
    seconds = collections.defaultdict(float)
    if args.compile:
        for key, launch in found.items():
            start = time.perf_counter()
            options = {name: launch.options[name] for name in ("num_warps", "num_stages")
                       if name in launch.options}
            compile_for_sm90(launch.kernel, launch.args, options)
            seconds[key[0]] += time.perf_counter() - start
    for name, count in per_kernel.most_common():
        timing = f", {seconds[name]:.1f} s to compile" if args.compile else ""
        print(f"{name}: {count} variants{timing}")
    total = sum(per_kernel.values())
    print(f"total: {total} variants" + (f", {sum(seconds.values()):.1f} s" if args.compile
                                        else ""))
    print(json.dumps({"max_num_seqs": args.max_num_seqs, "variants": total,
                      "per_kernel": dict(per_kernel),
                      "compile_seconds": round(sum(seconds.values()), 2) if args.compile
                      else None}))


if __name__ == "__main__":
    main()
