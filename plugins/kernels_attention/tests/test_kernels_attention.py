"""The qllm-kernels-attention plugin against the plain-torch reference (``qllm.ops.attention``).

- CUDA (skipped without a GPU): bf16 parity of decode and prefill over GQA ratios, page sizes,
  head dims, ragged lengths and cached prefixes; forced split counts; CUDA-graph replay;
  ``torch.compile``; ``opcheck``. The q/k norm + RoPE kernel against ``qllm.ops.rope`` at the
  Qwen3.5 (partial rotary, zero-centred norms) and Qwen3 (full rotary) head geometries; the
  K/V store bit for bit against ``index_put_``, and compiled, in place (no copy of the cache);
  with programmatic dependent launch (``QLLM_PDL``, the ``pdl`` tests), the q/k norm + RoPE,
  the decode, the K/V store and each feeding the decode in a replayed CUDA graph, the bits of
  PDL off.
- CPU: the custom ops' fake path under ``torch.compile(fullgraph=True)``, the plugin's
  registrations, the q/k norm + RoPE's and the decode's SASS compiled for sm_90 with PDL (the
  wait before any memory access) and without (no grid-dependency control), and parity at tiny
  shapes under the Triton interpreter. The interpreter must be switched on before Triton is
  imported, so ``test_triton_interpreter`` reruns this file's ``interpreted`` tests in a
  subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch

pytest.importorskip("qllm_kernels_attention")

# after the skip above, so the suite runs where the plugin is not installed
from qllm.testing.kernels import (HAS_TRITON, assert_compiled_store_in_place,  # noqa: E402
                                  called_ops, cuda, graphs_traced_by, interpreted,
                                  interpreter_driver)
from qllm.ops import attention, rope  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.pdl import (assert_graph_bits_equal, assert_pdl_sass,  # noqa: E402
                              require_pdl_gpu)
from qllm.testing.sm90 import on_meta  # noqa: E402
from qllm_kernels_attention import ops, plugin  # noqa: E402
from qllm_kernels_attention.testing import PagedInputs, paged_inputs, qk_inputs  # noqa: E402

TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _decode_case(q_heads, kv_heads, head_dim, page, seq_lens):
    """Decode inputs: one new token per sequence, the rest of ``seq_lens`` already cached."""
    return dict(query_lens=[1] * len(seq_lens), context_lens=[n - 1 for n in seq_lens],
                q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page=page)


def _prefill_case(q_heads, kv_heads, head_dim, page, query_lens, context_lens):
    return dict(query_lens=query_lens, context_lens=context_lens, q_heads=q_heads,
                kv_heads=kv_heads, head_dim=head_dim, page=page)


def _ragged(count: int, longest: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (count,), generator=gen).tolist()


GPU_DECODE = {
    "gqa2-d128-p256": _decode_case(16, 8, 128, 256, [1, 100, 513, 2048, 3000]),
    "gqa4-d64-p16": _decode_case(32, 8, 64, 16, [1, 17, 255, 1024]),
    "gqa8-d256-p32": _decode_case(16, 2, 256, 32, [5, 700]),
    "mha-d128-p64": _decode_case(8, 8, 128, 64, [33, 64, 65]),
    "gqa16-d128-p128": _decode_case(32, 2, 128, 128, [4097]),
    "gqa3-d128-p16": _decode_case(12, 4, 128, 16, [31, 300]),
    "b64-gqa2-d128-p256": _decode_case(16, 8, 128, 256, _ragged(64, 2048, seed=1)),
}
GPU_PREFILL = {
    "single-d128-p256": _prefill_case(16, 8, 128, 256, [300], [0]),
    "ragged-gqa4-d64-p16": _prefill_case(32, 8, 64, 16, [1, 17, 130, 257], [0, 0, 0, 0]),
    "prefix-gqa2-d128-p64": _prefill_case(16, 8, 128, 64, [5, 64, 200], [300, 0, 17]),
    "prefix-gqa8-d256-p32": _prefill_case(16, 2, 256, 32, [100, 33], [1000, 128]),
    "chunk-mha-d128-p16": _prefill_case(8, 8, 128, 16, [512], [1536]),
    "prefix-gqa16-d128-p128": _prefill_case(32, 2, 128, 128, [64, 129], [64, 3]),
}
TINY_DECODE = {
    "gqa2-d16-p4": _decode_case(4, 2, 16, 4, [1, 9, 40]),
    "gqa3-d32-p8": _decode_case(6, 2, 32, 8, [70, 3]),
}
TINY_PREFILL = {
    "ragged-gqa2-d16-p8": _prefill_case(4, 2, 16, 8, [5, 30, 1], [0, 13, 40]),
    "prefix-gqa3-d32-p4": _prefill_case(6, 2, 32, 4, [20, 70], [100, 3]),
}


def _reference(fn, x: PagedInputs, **gate) -> torch.Tensor:
    """The plain-torch op in fp32 on the same (rounded) inputs (and ``gate``, if given)."""
    gate = {name: g.float() for name, g in gate.items()}
    return fn(x.q.float(), x.k_cache.float(), x.v_cache.float(), x.batch, x.scale, **gate)


def _output_gate(q: torch.Tensor) -> torch.Tensor:
    """A gate for ``q [B, Hq, D]`` laid out as Qwen3.5's: the second half of each head's
    ``[q | gate]`` rows, a strided view."""
    g = torch.Generator(device=q.device).manual_seed(7)
    rows = torch.randn(*q.shape[:-1], 2 * q.shape[-1], generator=g, device=q.device)
    return (2 * rows).to(q.dtype)[..., q.shape[-1]:]


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def check_decode(case: dict, device: str, dtype: torch.dtype, num_splits: int | None,
                 gated: bool = False) -> None:
    """Decode through the registered function (automatic splits) or the launcher (forced),
    with Qwen3.5's output gate if ``gated``."""
    from qllm_kernels_attention.triton_decode import decode_attention

    x = paged_inputs(**case, dtype=dtype, device=device)
    gate = dict(gate=_output_gate(x.q)) if gated else {}
    if num_splits is None:
        out = ops.paged_attention_decode(x.q, x.k_cache, x.v_cache, x.batch, x.scale, **gate)
    else:
        out = decode_attention(x.q, x.k_cache, x.v_cache, x.batch.seq_lens,
                               x.batch.caches["paged_kv"].block_tables, x.scale,
                               num_splits=num_splits, **gate)
    _assert_close(out, _reference(attention.paged_attention_decode, x, **gate), dtype)


def check_prefill(case: dict, device: str, dtype: torch.dtype) -> None:
    x = paged_inputs(**case, dtype=dtype, device=device)
    out = ops.paged_attention_prefill(x.q, x.k_cache, x.v_cache, x.batch, x.scale)
    _assert_close(out, _reference(attention.paged_attention_prefill, x), dtype)


def opcheck_ops(device: str, dtype: torch.dtype) -> None:
    """``torch.library.opcheck`` on every custom op (schema, fake tensor, AOT dispatch; for
    ``kv_store``, that it mutates the caches alone)."""
    x = paged_inputs(**TINY_PREFILL["ragged-gqa2-d16-p8"], dtype=dtype, device=device)
    b = x.batch
    torch.library.opcheck(ops.paged_prefill, (
        x.q, x.k_cache, x.v_cache, b.query_start_loc, b.seq_lens, b.context_lens,
        b.caches["paged_kv"].block_tables, b.max_query_len, x.scale))
    x = paged_inputs(**TINY_DECODE["gqa2-d16-p4"], dtype=dtype, device=device)
    for gate in (None, _output_gate(x.q)):
        torch.library.opcheck(ops.paged_decode, (
            x.q, x.k_cache, x.v_cache, x.batch.seq_lens,
            x.batch.caches["paged_kv"].block_tables, x.scale, gate))
    torch.library.opcheck(ops.qk_norm_rope_heads, qk_inputs(**TINY_QK["partial-zc"], tokens=3,
                                                             dtype=dtype, device=device))
    torch.library.opcheck(ops.kv_store, kv_store_inputs(TINY_KV_STORE["decode-gqa2-d16-p4"],
                                                        dtype, device))
    torch.library.opcheck(ops.qk_norm_rope_kv_store_heads,
                          qk_norm_rope_kv_store_inputs(TINY_QK_STORE["decode-partial-zc"],
                                                       dtype, device))


# name -> q heads, k heads, head dim, rotary dims, zero-centred norm weights
GPU_QK = {"qwen3.5": dict(q_heads=16, k_heads=2, head_dim=256, rotary_dim=64,
                          zero_centered=True),
          "qwen3": dict(q_heads=16, k_heads=8, head_dim=128, rotary_dim=128,
                        zero_centered=False)}
TINY_QK = {"partial-zc": dict(q_heads=4, k_heads=2, head_dim=16, rotary_dim=8,
                              zero_centered=True),
           "full-half6": dict(q_heads=3, k_heads=1, head_dim=12, rotary_dim=12,
                              zero_centered=False)}


def check_qk_norm_rope(case: dict, tokens: int, dtype: torch.dtype, device: str) -> None:
    args = qk_inputs(**case, tokens=tokens, dtype=dtype, device=device)
    q, k = ops.qk_norm_rope(*args)
    expected_q, expected_k = rope.qk_norm_rope(*args)
    assert q.is_contiguous() and k.is_contiguous()
    _assert_close(q, expected_q.float(), dtype)
    _assert_close(k, expected_k.float(), dtype)


def kv_store_inputs(case: dict, dtype: torch.dtype, device: str, cache_dtype=None):
    """Caches and new rows for ``kv_store``: ``k, v [T, Hkv, D]`` strided as the attention
    layers' splits of one ``[T, (Hq + 2 Hkv) D]`` projection, written to ``case``'s new
    tokens' slots."""
    x = paged_inputs(**case, dtype=cache_dtype or dtype, device=device)
    tokens, q_heads, head_dim = x.q.shape
    kv_heads = x.k_cache.shape[2]
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    _, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (x.k_cache, x.v_cache, k.unflatten(-1, (kv_heads, head_dim)),
            v.unflatten(-1, (kv_heads, head_dim)), x.batch.caches["paged_kv"].slot_mapping)


def check_kv_store(case: dict, dtype: torch.dtype, device: str, cache_dtype=None) -> None:
    """The Triton store writes exactly what ``index_put_`` writes, and nothing else."""
    k_cache, v_cache, k, v, slot_mapping = kv_store_inputs(case, dtype, device, cache_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    attention.kv_store(expected_k, expected_v, k, v, slot_mapping)
    ops.kv_store(k_cache, v_cache, k, v, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def qk_norm_rope_kv_store_inputs(case: tuple, dtype: torch.dtype, device: str,
                                 cache_dtype=None) -> tuple:
    """``qk_norm_rope_kv_store``'s arguments for ``case`` (paged_inputs case, rotary dims,
    zero-centred weights): ``qk_inputs`` and ``kv_store_inputs`` of its new tokens."""
    paged, rotary_dim, zero_centered = case
    k_cache, v_cache, _, v, slot_mapping = kv_store_inputs(paged, dtype, device, cache_dtype)
    q, k, *rest = qk_inputs(paged["q_heads"], paged["kv_heads"], paged["head_dim"], rotary_dim,
                            zero_centered, tokens=v.shape[0], dtype=dtype, device=device)
    return (q, k, v, *rest, k_cache, v_cache, slot_mapping)


def check_qk_norm_rope_kv_store(case: tuple, dtype: torch.dtype, device: str,
                                cache_dtype=None) -> None:
    """The fused kernel writes the bits of the q/k norm + RoPE kernel followed by the K/V
    store kernel (q and both caches), and matches the plain-torch reference."""
    q, k, v, *rest, k_cache, v_cache, slot_mapping = qk_norm_rope_kv_store_inputs(
        case, dtype, device, cache_dtype)
    unfused_k, unfused_v = k_cache.clone(), v_cache.clone()
    reference_k, reference_v = k_cache.float(), v_cache.float()
    unfused_q, rotated_k = ops.qk_norm_rope(q, k, *rest)
    ops.kv_store(unfused_k, unfused_v, rotated_k, v, slot_mapping)
    out = ops.qk_norm_rope_kv_store(q, k, v, *rest, k_cache, v_cache, slot_mapping)
    assert out.is_contiguous() and torch.equal(out, unfused_q)
    assert torch.equal(k_cache, unfused_k) and torch.equal(v_cache, unfused_v)
    expected_q = attention.qk_norm_rope_kv_store(q, k, v, *rest, reference_k, reference_v,
                                                 slot_mapping)
    _assert_close(out, expected_q.float(), dtype)
    _assert_close(k_cache, reference_k, k_cache.dtype)
    assert torch.equal(v_cache, reference_v.to(v_cache.dtype))


# name -> paged_inputs case (the new tokens are the rows stored)
GPU_KV_STORE = {"decode-b64-gqa2-d128-p256": GPU_DECODE["b64-gqa2-d128-p256"],
                "decode-qwen3.5-d256-p32": _decode_case(16, 2, 256, 32, [700]),
                "prefill-gqa8-d256-p32": GPU_PREFILL["prefix-gqa8-d256-p32"],
                "prefill-gqa4-d64-p16": GPU_PREFILL["ragged-gqa4-d64-p16"]}
TINY_KV_STORE = {"decode-gqa2-d16-p4": TINY_DECODE["gqa2-d16-p4"],
                 "prefill-gqa3-d32-p4": TINY_PREFILL["prefix-gqa3-d32-p4"],
                 "heads3-d12-p8": _prefill_case(3, 3, 12, 8, [9, 2], [0, 5])}
# name -> paged_inputs case, rotary dims, zero-centred norm weights
GPU_QK_STORE = {"qwen3.5-decode": (GPU_KV_STORE["decode-qwen3.5-d256-p32"], 64, True),
                "qwen3-decode-b64": (GPU_KV_STORE["decode-b64-gqa2-d128-p256"], 128, False),
                "qwen3-prefill": (_prefill_case(16, 8, 128, 16, [300, 77], [0, 40]), 128,
                                  False)}
TINY_QK_STORE = {"decode-partial-zc": (TINY_DECODE["gqa2-d16-p4"], 8, True),
                 "prefill-full": (TINY_PREFILL["prefix-gqa3-d32-p4"], 32, False),
                 # past PER_HEAD_MAX_TOKENS: a program per token, every head at once
                 "prefill-300-half6": (_prefill_case(3, 1, 12, 8, [300], [5]), 12, False)}


# ----------------------------------------------------------------------------- CUDA

@cuda
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("num_splits", [None, 1, 7], ids=["auto", "split1", "split7"])
@pytest.mark.parametrize("case", GPU_DECODE.values(), ids=GPU_DECODE.keys())
def test_decode_parity(case, num_splits, gated):
    check_decode(case, "cuda", torch.bfloat16, num_splits, gated)


@cuda
@pytest.mark.parametrize("case", GPU_PREFILL.values(), ids=GPU_PREFILL.keys())
def test_prefill_parity(case):
    check_prefill(case, "cuda", torch.bfloat16)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 200, 3001])
@pytest.mark.parametrize("case", GPU_QK.values(), ids=GPU_QK.keys())
def test_qk_norm_rope_parity(case, tokens, dtype):
    check_qk_norm_rope(case, tokens, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_KV_STORE.values(), ids=GPU_KV_STORE.keys())
def test_kv_store_parity(case, dtype):
    check_kv_store(case, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_QK_STORE.values(), ids=GPU_QK_STORE.keys())
def test_qk_norm_rope_kv_store_parity(case, dtype):
    check_qk_norm_rope_kv_store(case, dtype, "cuda")


@cuda
def test_kv_store_casts_to_the_cache_dtype():
    check_kv_store(GPU_KV_STORE["decode-qwen3.5-d256-p32"], torch.float32, "cuda",
                   cache_dtype=torch.bfloat16)


@cuda
def test_compiled_kv_store_writes_in_place():
    """Compiled, the store writes into the cache, not into a copy of it (a functionalized
    mutation copied back would cost each layer its whole cache twice per step)."""
    assert_compiled_store_in_place(ops.kv_store)


@cuda
def test_compiled_qk_norm_rope_kv_store_writes_in_place():
    """The same of the q/k norm + RoPE storing its keys and the values (MHA, 8 heads of 128:
    the helper's keys serve as queries too)."""
    weight = torch.rand(128, device="cuda").to(torch.bfloat16) + 0.5
    cos_sin = torch.randn(64, 128, device="cuda")  # [positions, rotary dims]
    positions = torch.arange(64, device="cuda")
    norm_rope = (weight, weight, cos_sin, positions, 1e-6, False)

    def rotate_and_store(k_cache, v_cache, k, v, slot_mapping):
        ops.qk_norm_rope_kv_store(k, k, v, *norm_rope, k_cache, v_cache, slot_mapping)

    assert_compiled_store_in_place(rotate_and_store,
                                   lambda k: ops.qk_norm_rope(k, k, *norm_rope)[1])


@cuda
def test_decode_fp16():
    check_decode(GPU_DECODE["gqa2-d128-p256"], "cuda", torch.float16, None)
    check_prefill(GPU_PREFILL["prefix-gqa2-d128-p64"], "cuda", torch.float16)


@cuda
def test_decode_cuda_graph_replay():
    """Captured once, replayed after the lengths (and queries) change in place."""
    x = paged_inputs(**GPU_DECODE["gqa2-d128-p256"], device="cuda")
    b = x.batch
    ops.paged_attention_decode(x.q, x.k_cache, x.v_cache, b, x.scale)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention_decode(x.q, x.k_cache, x.v_cache, b, x.scale)
    for seq_lens in ([1, 1, 1, 1, 1], [7, 200, 700, 1500, 3072]):  # within each row's pages
        b.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        x.q.normal_()
        graph.replay()
        _assert_close(out, _reference(attention.paged_attention_decode, x), torch.bfloat16)


@cuda
def test_compiled_decode_matches_eager():
    x = paged_inputs(**GPU_DECODE["gqa4-d64-p16"], device="cuda")
    compiled = torch.compile(ops.paged_attention_decode, fullgraph=True,
                             mode="reduce-overhead")
    eager = ops.paged_attention_decode(x.q, x.k_cache, x.v_cache, x.batch, x.scale)
    for _ in range(3):  # warm-up, record, replay
        out = compiled(x.q, x.k_cache, x.v_cache, x.batch, x.scale)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


# Qwen3.5-35B-A3B's attention layer at decode: one sequence of 700 tokens
PDL_DECODE = _decode_case(16, 2, 256, 32, [700])


@cuda
@pytest.mark.parametrize("step", ["qk_norm_rope", "paged_decode", "qk_norm_rope+paged_decode",
                                  "kv_store+paged_decode", "qk_norm_rope_kv_store+paged_decode"])
def test_pdl_decode_in_cuda_graph(step, monkeypatch):
    """With ``QLLM_PDL`` on, Qwen3.5's attention decode at one token: the q/k norm + RoPE, the
    split and merge kernels of the decode, the first feeding the second, and the K/V store
    before the decode (its own kernel, or the q/k norm + RoPE storing them), eagerly and in a
    CUDA graph replayed 100 times, give the bits of PDL off."""
    require_pdl_gpu()
    x = paged_inputs(**PDL_DECODE, device="cuda")
    qk_args = qk_inputs(**GPU_QK["qwen3.5"], tokens=1, dtype=torch.bfloat16, device="cuda")
    _, _, new_k, new_v, slot_mapping = kv_store_inputs(PDL_DECODE, torch.bfloat16, "cuda")

    def attend(q: torch.Tensor) -> torch.Tensor:
        return ops.paged_attention_decode(q, x.k_cache, x.v_cache, x.batch, x.scale)

    def store_then_attend() -> torch.Tensor:
        ops.kv_store(x.k_cache, x.v_cache, new_k, new_v, slot_mapping)
        return attend(x.q)

    def rotate_store_attend() -> torch.Tensor:
        q, k, *rest = qk_args
        return attend(ops.qk_norm_rope_kv_store(q, k, new_v, *rest, x.k_cache, x.v_cache,
                                                slot_mapping))

    steps = {"qk_norm_rope": lambda: ops.qk_norm_rope(*qk_args),
             "paged_decode": lambda: attend(x.q),
             "qk_norm_rope+paged_decode": lambda: attend(ops.qk_norm_rope(*qk_args)[0]),
             "kv_store+paged_decode": store_then_attend,
             "qk_norm_rope_kv_store+paged_decode": rotate_store_attend}
    assert_graph_bits_equal(steps[step], monkeypatch)


@cuda
def test_opcheck_cuda():
    opcheck_ops("cuda", torch.bfloat16)


# ----------------------------------------------------------------------------- CPU

def _to_meta(x: PagedInputs) -> PagedInputs:
    def meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    batch = dataclasses.replace(x.batch, **{f.name: meta(getattr(x.batch, f.name))
                                            for f in dataclasses.fields(x.batch)})
    return PagedInputs(meta(x.q), meta(x.k_cache), meta(x.v_cache), batch, x.scale)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_compile_fullgraph_on_fake_path(op):
    """Dynamo and AOT autograd trace the registered functions into one graph holding the
    custom op, and the fake implementation gives the output (meta tensors: no kernel runs)."""
    fn, case = ((ops.paged_attention_decode, TINY_DECODE["gqa2-d16-p4"]) if op == "decode"
                else (ops.paged_attention_prefill, TINY_PREFILL["ragged-gqa2-d16-p8"]))
    x = _to_meta(paged_inputs(**case))

    def run(backend):
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        out = compiled(x.q, x.k_cache, x.v_cache, x.batch, x.scale)
        assert out.device.type == "meta" and out.shape == x.q.shape and out.dtype == x.q.dtype

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph) == [getattr(torch.ops.qllm_attn, f"paged_{op}").default]


def test_qk_norm_rope_compiles_on_fake_path():
    """The q/k norm + RoPE op traces into one ``fullgraph`` node over meta tensors."""
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in qk_inputs(**TINY_QK["partial-zc"], tokens=3, dtype=torch.bfloat16,
                               device="cpu")]

    def run(backend):
        q, k = torch.compile(ops.qk_norm_rope, fullgraph=True, backend=backend)(*args)
        assert q.device.type == "meta" and q.shape == args[0].shape and q.is_contiguous()
        assert k.shape == args[1].shape and k.dtype == torch.bfloat16

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph)[0] == torch.ops.qllm_attn.qk_norm_rope.default
    assert all(target is operator.getitem for target in called_ops(graph)[1:])  # its (q, k)


def test_kv_store_compiles_on_fake_path():
    """The K/V store traces into one ``fullgraph`` node over meta tensors, its caches
    mutated in place."""
    args = [a.to("meta") for a in kv_store_inputs(TINY_KV_STORE["decode-gqa2-d16-p4"],
                                                  torch.bfloat16, "cpu")]

    def run(backend):
        torch.compile(ops.kv_store, fullgraph=True, backend=backend)(*args)

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph) == [torch.ops.qllm_attn.kv_store.default]


def test_qk_norm_rope_kv_store_compiles_on_fake_path():
    """The q/k norm + RoPE storing K/V traces into one ``fullgraph`` node over meta tensors,
    its caches mutated in place."""
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in qk_norm_rope_kv_store_inputs(TINY_QK_STORE["decode-partial-zc"],
                                                  torch.bfloat16, "cpu")]

    def run(backend):
        q = torch.compile(ops.qk_norm_rope_kv_store, fullgraph=True, backend=backend)(*args)
        assert q.device.type == "meta" and q.shape == args[0].shape and q.is_contiguous()

    (graph,) = graphs_traced_by(run)
    assert called_ops(graph) == [torch.ops.qllm_attn.qk_norm_rope_kv_store.default]


def test_plugin_registrations():
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    best = "flash_attn" if plugin.HAS_FLASH_ATTN else "triton" if HAS_TRITON else "torch"
    any_float = "triton" if HAS_TRITON else "torch"  # ops registered for every float dtype
    names = registry.kernels(torch.device("cuda"), torch.bfloat16).names()
    assert names["paged_attention_decode"] == names["paged_attention_prefill"] == best
    any_float_ops = ("kv_store", "qk_norm_rope", "qk_norm_rope_kv_store")
    assert {names[op] for op in any_float_ops} == {any_float}
    names = registry.kernels(torch.device("cuda"), torch.float32).names()
    assert {names[op] for op in any_float_ops} == {any_float}
    assert {names[op] for op in names if op not in any_float_ops} == {"torch"}
    names = registry.kernels(torch.device("cpu"), torch.bfloat16).names()
    assert set(names.values()) == {"torch"}


def _pdl_launch(op: str):
    """The launch of the q/k norm + RoPE (alone or storing K/V), of the decode's split and
    merge kernels (four
    splits: the SM count stands in as 4 off the GPU), or of the K/V store, for Qwen3.5's
    attention at one token, on ``meta`` tensors."""
    from qllm_kernels_attention.triton_decode import decode_attention
    from qllm_kernels_attention.triton_qk_norm_rope import qk_norm_rope

    if op == "qk_norm_rope":
        q, k, *weights, cos_sin, positions, eps, zero_centered = qk_inputs(
            **GPU_QK["qwen3.5"], tokens=1, dtype=torch.bfloat16, device="cpu")
        tensors = on_meta(q, k, *weights, cos_sin, positions)
        return lambda: qk_norm_rope(*tensors, eps, zero_centered)
    if op == "qk_norm_rope_kv_store":
        from qllm_kernels_attention.triton_qk_norm_rope import qk_norm_rope_kv_store

        args = [on_meta(a)[0] if isinstance(a, torch.Tensor) else a
                for a in qk_norm_rope_kv_store_inputs(GPU_QK_STORE["qwen3.5-decode"],
                                                      torch.bfloat16, "cpu")]
        return lambda: qk_norm_rope_kv_store(*args)
    if op == "kv_store":
        from qllm_kernels_attention.triton_kv_store import store_kv

        tensors = on_meta(*kv_store_inputs(PDL_DECODE, torch.bfloat16, "cpu"))
        return lambda: store_kv(*tensors)
    x = paged_inputs(**PDL_DECODE)
    *tensors, gate = on_meta(x.q, x.k_cache, x.v_cache, x.batch.seq_lens,
                             x.batch.caches["paged_kv"].block_tables, _output_gate(x.q))
    return lambda: decode_attention(*tensors, x.scale, gate)  # gated, as Qwen3.5's


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("op", ["qk_norm_rope", "paged_decode", "kv_store",
                                "qk_norm_rope_kv_store"])
def test_pdl_sass(op, monkeypatch):
    """The q/k norm + RoPE kernel (alone and storing K/V), the decode's split and merge
    kernels and the K/V store,
    compiled for sm_90 as launched: with PDL each waits before any store, the decode's at
    entry, the others after reading the step's positions or slots and the weights
    (``qllm.testing.pdl.assert_pdl_sass``); without, no grid-dependency-control
    instruction."""
    assert_pdl_sass(_pdl_launch(op), monkeypatch, reads_before_wait=op != "paged_decode")


test_triton_interpreter = interpreter_driver(__file__, "-W",
                                             "ignore:divide by zero:RuntimeWarning")


# The interpreter's tl.dot reads bf16 as raw integers, so these use fp16 and fp32.
@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "split1", "split3"])
@pytest.mark.parametrize("case", TINY_DECODE.values(), ids=TINY_DECODE.keys())
def test_interpreted_decode(case, num_splits, dtype, gated):
    check_decode(case, "cpu", dtype, num_splits, gated)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", TINY_PREFILL.values(), ids=TINY_PREFILL.keys())
def test_interpreted_prefill(case, dtype):
    check_prefill(case, "cpu", dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("tokens", [1, 5, 300])  # 300: past PER_HEAD_MAX_TOKENS
@pytest.mark.parametrize("case", TINY_QK.values(), ids=TINY_QK.keys())
def test_interpreted_qk_norm_rope(case, tokens, dtype):
    check_qk_norm_rope(case, tokens, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", TINY_KV_STORE.values(), ids=TINY_KV_STORE.keys())
def test_interpreted_kv_store(case, dtype):
    check_kv_store(case, dtype, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", TINY_QK_STORE.values(), ids=TINY_QK_STORE.keys())
def test_interpreted_qk_norm_rope_kv_store(case, dtype):
    check_qk_norm_rope_kv_store(case, dtype, "cpu")


@interpreted
def test_interpreted_qk_norm_rope_kv_store_casts_to_the_cache_dtype():
    check_qk_norm_rope_kv_store(TINY_QK_STORE["decode-partial-zc"], torch.float32, "cpu",
                                cache_dtype=torch.float16)


@interpreted
def test_interpreted_kv_store_casts_to_the_cache_dtype():
    check_kv_store(TINY_KV_STORE["heads3-d12-p8"], torch.float32, "cpu",
                   cache_dtype=torch.float16)


@interpreted
def test_interpreted_opcheck():
    opcheck_ops("cpu", torch.float16)
