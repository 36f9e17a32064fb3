"""The op contracts: every op that the engine and the model plugins call through
``kernels.<op>``, declared once.

An op is its name, its plain-torch reference (whose docstring is the full contract and whose
parameters every kernel of the op takes, same names, same order) and a line on what it
computes. ``qllm.plugins.builtins`` registers each reference as the op's ``torch`` kernel
(priority 0, every device); kernel plugins register faster implementations only. An op a plugin defines
for its own modules (a weight format's 8-bit ops) has the ``torch`` kernel that plugin
registers as its reference. ``qllm.plugins.registry.PluginRegistry.kernels`` checks every kernel's
parameters against its op's reference when an engine starts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from qllm.ops import attention, gdn, linear, moe, norm, rope, sampling


@dataclass(frozen=True)
class OpContract:
    """One op: ``reference``'s signature is the contract; ``description`` says what it does."""

    name: str
    reference: Callable[..., Any]
    description: str


CORE_OPS: tuple[OpContract, ...] = (
    OpContract("linear", linear.linear, "a dense projection, x @ weight.T + bias"),
    OpContract("add_rms_norm", norm.add_rms_norm,
               "the residual add (a branch's partial outputs summed first), then RMSNorm"),
    OpContract("add_rms_norm_linear", linear.add_rms_norm_linear,
               "add_rms_norm, then a projection of its output (the two fused by kernels)"),
    OpContract("rms_norm_gated", norm.rms_norm_gated,
               "RMSNorm times silu(gate), closing a Gated DeltaNet layer"),
    OpContract("qk_norm_rope", rope.qk_norm_rope,
               "per-head RMSNorm of q and k, then the rotary embedding"),
    OpContract("kv_store", attention.kv_store,
               "writes a step's keys and values into the paged KV cache, in place"),
    OpContract("qk_norm_rope_kv_store", attention.qk_norm_rope_kv_store,
               "qk_norm_rope, its keys and the values then written into the paged KV cache"),
    OpContract("paged_attention_prefill", attention.paged_attention_prefill,
               "causal attention of packed new tokens over the paged KV cache (eager)"),
    OpContract("paged_attention_decode", attention.paged_attention_decode,
               "one query per sequence over the paged KV cache (graph-capturable)"),
    OpContract("causal_conv1d_prefill", gdn.causal_conv1d_prefill,
               "the depthwise causal conv + SiLU over packed new tokens, carrying the state"),
    OpContract("causal_conv1d_update", gdn.causal_conv1d_update,
               "one token per sequence of the causal conv + SiLU (graph-capturable)"),
    OpContract("gdn_prefill", gdn.gdn_prefill,
               "the chunked gated delta rule over packed new tokens, carrying the state"),
    OpContract("gdn_decode", gdn.gdn_decode,
               "one recurrent gated-delta-rule step per sequence (graph-capturable)"),
    OpContract("gdn_decode_gated_norm", gdn.gdn_decode_gated_norm,
               "gdn_decode, then the layer's gated RMSNorm of its output (graph-capturable)"),
    OpContract("moe_router", moe.moe_router,
               "softmax top-k routing, then the shared expert's sigmoid-gated slot"),
    OpContract("fused_moe", moe.fused_moe,
               "the SwiGLU experts of each token's routed slots, weighted, unsummed"),
    OpContract("sample_tokens", sampling.sample_tokens,
               "a token per row drawn from softmax(logits / temperature), argmax at 0"),
)


def kernel_parameters(fn: Callable[..., Any]) -> list[str]:
    """The parameter names of a kernel: a Python function's, or a ``torch.library`` custom
    op's (from its schema)."""
    if isinstance(fn, torch.library.CustomOpDef):
        namespace, name = fn._qualname.split("::")
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
        return [argument.name for argument in schema.arguments]
    return list(inspect.signature(fn).parameters)


def parameter_mismatch(kernel: Callable[..., Any], reference: Callable[..., Any]) -> str | None:
    """How ``kernel``'s parameters differ from ``reference``'s, or ``None`` when they are the
    same names in the same order."""
    got, want = kernel_parameters(kernel), kernel_parameters(reference)
    if got == want:
        return None
    missing = [name for name in want if name not in got]
    unexpected = [name for name in got if name not in want]
    differences = ([f"missing {missing}"] if missing else []) + (
        [f"unexpected {unexpected}"] if unexpected else [])
    detail = "; ".join(differences) or "the same names in another order"
    return (f"takes ({', '.join(got)}), the reference {_qualified_name(reference)} takes "
            f"({', '.join(want)}): {detail}")


def _qualified_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, torch.library.CustomOpDef):
        return fn._qualname
    return f"{fn.__module__}.{fn.__qualname__}"
