"""The qllm-kernels-moe plugin against the plain-torch ``fused_moe`` (``qllm.ops.moe``).

- CUDA (skipped without a GPU): bf16 parity for T in {1, 7, 64, 256, 2048} at the
  Qwen3.5-35B-A3B shape and two smaller ones, skewed routing, every entry of the shipped
  block-size table, forced configs, fp16, CUDA-graph replay, compiled decode, ``opcheck``, the
  Triton sort against ``moe_align`` and the Triton router against ``moe_router``; with
  programmatic dependent launch (``QLLM_PDL``, the ``pdl`` tests), the router, the slot path
  and the router feeding it in a replayed CUDA graph, the bits of PDL off.
- CPU: the sort (``moe_align``) against a naive layout, the config tables, the custom op's
  fake path under ``torch.compile(fullgraph=True)``, the plugin's registration, the router's
  and the slot path's SASS compiled for sm_90 with PDL (the wait before any memory access) and
  without (no grid-dependency control), and, under the
  Triton interpreter, the Triton align against ``moe_align``, the router against
  ``moe_router`` and parity at tiny shapes. The interpreter must be switched on before Triton is
  imported, so ``test_triton_interpreter`` reruns this file's ``interpreted`` tests in a
  subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("qllm_kernels_moe")

# after the skips above, so the suite runs where the plugin is not installed
from qllm.testing.kernels import (HAS_TRITON, called_ops, cuda, graphs_traced_by,  # noqa: E402
                                  interpreted, interpreter_driver)
from qllm.ops import moe as reference  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.pdl import (assert_graph_bits_equal, assert_pdl_sass,  # noqa: E402
                              require_pdl_gpu)
from qllm_kernels_moe import ops, plugin  # noqa: E402
from qllm_kernels_moe.align import max_padded_slots, moe_align  # noqa: E402
from qllm_kernels_moe.configs import (GemmConfig, MoeConfig, default_config,  # noqa: E402
                                      get_config, load_table)
from qllm_kernels_moe.testing import MoeInputs, moe_inputs  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


# name -> (experts, top_k, hidden, expert intermediate)
GPU_SHAPES = {
    "35b-a3b": (256, 8, 2048, 512),
    "e64-k4": (64, 4, 512, 256),
    "e8-k2-i96": (8, 2, 256, 96),  # I not a multiple of the column tiles
}
GPU_TOKENS = (1, 7, 64, 256, 2048)
FORCED = {  # every BLOCK_M, and tiles that leave partial column / K tiles
    "m1": MoeConfig(1, GemmConfig(16, 128, num_stages=2), GemmConfig(32, 128, 1, 8, 1)),
    "m16": MoeConfig(16, GemmConfig(32, 64), GemmConfig(64, 128, 4)),
    "m32": MoeConfig(32, GemmConfig(64, 128, 8, 8, 4), GemmConfig(128, 64, 1, 4, 2)),
    "m64": MoeConfig(64, GemmConfig(128, 64), GemmConfig(256, 64, 8, 8, 3)),
    "m128": MoeConfig(128, GemmConfig(64, 64, 1, 8, 4), GemmConfig(128, 32, 1, 8, 4)),
    "m1-persistent": MoeConfig(1, GemmConfig(4, 512), GemmConfig(16, 128), 8),
    "m1-prefetch": MoeConfig(1, GemmConfig(16, 128, num_stages=2), GemmConfig(32, 128, 1, 8, 1),
                             prefetch_down=True),
}
# name -> (tokens, experts, top_k, hidden, intermediate, skew)
TINY = {
    "t1-e8-k2": (1, 8, 2, 32, 16, 0.0),
    "t7-e8-k2-h48-i24": (7, 8, 2, 48, 24, 0.0),
    "t33-e6-k2-skewed": (33, 6, 2, 32, 16, 10.0),
    "t40-e16-k4": (40, 16, 4, 64, 32, 0.0),
}
TINY_CONFIGS = {
    "default": None,
    "m1": MoeConfig(1, GemmConfig(8, 16), GemmConfig(16, 16, 1, 2)),
    "m1-whole-k": MoeConfig(1, GemmConfig(8, 64), GemmConfig(16, 32, 1, 2)),  # one tile a row
    "m16": MoeConfig(16, GemmConfig(16, 32), GemmConfig(32, 16, 2)),
    "m32": MoeConfig(32, GemmConfig(32, 16, 4), GemmConfig(16, 32)),
}
# the slot path's gate-up with programs that each compute several tiles (on the CPU's 4
# stand-in multiprocessors), or both GEMMs in the persistent kernel (one program on the CPU),
# at the TINY cases of at most 33 tokens
LOOPED_CONFIGS = {
    "m1-looped": MoeConfig(1, GemmConfig(8, 16, programs_per_sm=1), GemmConfig(16, 16, 1, 2)),
    "m1-whole-k-looped": MoeConfig(1, GemmConfig(8, 64, programs_per_sm=3),
                                   GemmConfig(16, 32, 1, 2)),
    "m1-persistent": MoeConfig(1, GemmConfig(8, 16), GemmConfig(16, 16), 2),
    "m1-whole-k-persistent": MoeConfig(1, GemmConfig(8, 64), GemmConfig(16, 32), 2),
}
LOOPED_CASES = {name: case for name, case in TINY.items() if case[0] <= 33}


def _reference(inputs: MoeInputs) -> torch.Tensor:
    """The plain-torch op in fp32 on the same (rounded) inputs."""
    x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2 = inputs
    return reference.fused_moe(x.float(), w13.float(), w2.float(), topk_weights.float(),
                               topk_ids, shared_w13.float(), shared_w2.float())


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def check_parity(inputs: MoeInputs, config: MoeConfig | None = None) -> None:
    """Through the custom op (table config), or the launcher with a forced config."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton

    out = ops.fused_moe(*inputs) if config is None else fused_moe_triton(*inputs, config=config)
    _assert_close(out, _reference(inputs), inputs.x.dtype)


def opcheck_op(device: str, dtype: torch.dtype) -> None:
    """``torch.library.opcheck`` (schema, fake tensor, AOT dispatch) on the custom ops."""
    torch.library.opcheck(ops.fused_moe, tuple(moe_inputs(9, 8, 32, 16, 2, dtype, device)))
    torch.library.opcheck(ops.moe_router, (router_logits(9, 16, dtype, device), 4, True))


# name -> (tokens, experts, top_k, renormalize)
ROUTER_CASES = {"t1-e256-k8": (1, 256, 8, True), "t7-e8-k2-raw": (7, 8, 2, False),
                "t33-e6-k2": (33, 6, 2, True), "t5-e60-k4": (5, 60, 4, True),
                "t0-e16-k4": (0, 16, 4, True), "t300-e256-k8": (300, 256, 8, True)}
router_cases = pytest.mark.parametrize("tokens,experts,top_k,renormalize",
                                       ROUTER_CASES.values(), ids=ROUTER_CASES.keys())


def router_logits(tokens: int, experts: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[T, E + 1]``: router logits distinct within each row (a tie would let either expert
    win), a random permutation of multiples of 1/16, exact in fp16 and bf16 up to 256 experts;
    then the shared expert's gate logit, a multiple of 1/16 in [-4, 4)."""
    generator = torch.Generator().manual_seed(tokens * 1000 + experts)
    rows = [torch.randperm(experts, generator=generator) for _ in range(tokens)]
    logits = torch.stack(rows) if rows else torch.empty(0, experts, dtype=torch.long)
    gate = torch.randint(-64, 64, (tokens, 1), generator=generator)
    return (torch.cat([logits, gate], dim=1).float() / 16).to(dtype).to(device)


def check_router(tokens, experts, top_k, renormalize, dtype, device) -> None:
    """The Triton router against the plain-torch ``moe_router``: same experts, same order,
    weights within rounding."""
    logits = router_logits(tokens, experts, dtype, device)
    weights, ids = ops.moe_router(logits, top_k, renormalize)
    expected_weights, expected_ids = reference.moe_router(logits, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    assert weights.dtype == dtype
    torch.testing.assert_close(weights.float(), expected_weights.float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# ----------------------------------------------------------------------------- CUDA

@cuda
@pytest.mark.parametrize("tokens", GPU_TOKENS, ids=lambda n: f"t{n}")
@pytest.mark.parametrize("shape", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
def test_parity(shape, tokens):
    experts, top_k, hidden, inter = shape
    check_parity(moe_inputs(tokens, experts, hidden, inter, top_k, device="cuda"))


@cuda
@pytest.mark.parametrize("tokens", [5, 256], ids=lambda n: f"t{n}")
def test_skewed_routing(tokens):
    """Every token on the same 8 experts: many blocks per expert, 248 experts idle."""
    check_parity(moe_inputs(tokens, 256, 2048, 512, 8, device="cuda", skew=10.0))


@cuda
@pytest.mark.parametrize("max_tokens", sorted(load_table(256, 1024, 2048)))
def test_every_table_entry(max_tokens):
    """Each shipped config compiles and is correct at the top of its token range."""
    config = load_table(256, 1024, 2048)[max_tokens]
    check_parity(moe_inputs(max_tokens, 256, 2048, 512, 8, device="cuda"), config)


@cuda
@pytest.mark.parametrize("tokens", [3, 300], ids=lambda n: f"t{n}")
@pytest.mark.parametrize("config", FORCED.values(), ids=FORCED.keys())
def test_forced_configs(config, tokens):
    check_parity(moe_inputs(tokens, 64, 512, 200, 4, device="cuda"), config)


@cuda
def test_slot_prefetch_down_changes_no_bit():
    """The gate-up asking L2 for the down's weights (``prefetch_down``) at one token of
    Qwen3.5-35B-A3B, on the shipped entry's tiles: the bits of the entry without it."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton

    experts, top_k, hidden, inter = GPU_SHAPES["35b-a3b"]
    config = load_table(experts, 2 * inter, hidden)[1]
    prefetching = dataclasses.replace(config, prefetch_down=True)
    for seed in range(3):
        inputs = moe_inputs(1, experts, hidden, inter, top_k, device="cuda", seed=seed)
        assert torch.equal(fused_moe_triton(*inputs, config=prefetching),
                           fused_moe_triton(*inputs, config=config)), f"seed {seed}"


@cuda
def test_fp16_and_strided_x():
    inputs = moe_inputs(64, 64, 512, 256, 4, torch.float16, "cuda")
    check_parity(inputs)
    wide = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    check_parity(inputs._replace(x=wide[:, ::2]))  # every other column: stride 2


@cuda
def test_cuda_graph_replay():
    """Captured once, replayed after the routing (and activations) change in place."""
    inputs = moe_inputs(64, 64, 512, 256, 4, device="cuda")
    ops.fused_moe(*inputs)  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(*inputs)
    for seed, skew in ((1, 0.0), (2, 10.0)):
        new = moe_inputs(64, 64, 512, 256, 4, device="cuda", seed=seed, skew=skew)
        for name in ("x", "topk_weights", "topk_ids"):
            getattr(inputs, name).copy_(getattr(new, name))
        graph.replay()
        _assert_close(out, _reference(inputs), torch.bfloat16)


@cuda
@pytest.mark.parametrize("per_sm", [1, 8])
def test_persistent_slot_moe_replayed(per_sm):
    """The slot path's persistent kernel (both GEMMs, programs waiting on each other's tiles)
    at one token of Qwen3.5-35B-A3B, captured once and replayed with new routing: every replay
    equals the same kernel run eagerly (all its down tiles waited for their slots), and leaves
    its counters zero for the next."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton
    from qllm_kernels_moe.triton_slot_moe import _slot_counters

    experts, top_k, hidden, inter = GPU_SHAPES["35b-a3b"]
    config = MoeConfig(1, GemmConfig(1, 2048, num_warps=4, num_stages=1),
                       GemmConfig(4, 512), per_sm)
    inputs = moe_inputs(1, experts, hidden, inter, top_k, device="cuda")
    eager = fused_moe_triton(*inputs, config=config)  # compiles, creates the counters
    _assert_close(eager, _reference(inputs), torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(*inputs, config=config)
    for seed in range(1, 21):
        new = moe_inputs(1, experts, hidden, inter, top_k, device="cuda", seed=seed)
        for name in ("x", "topk_weights", "topk_ids"):
            getattr(inputs, name).copy_(getattr(new, name))
        graph.replay()
        assert torch.equal(out, fused_moe_triton(*inputs, config=config)), f"replay {seed}"
    assert not _slot_counters(inputs.x.device, 0).any()


@cuda
def test_compiled_decode_matches_eager():
    """A ``fullgraph`` CUDA-graph compile with a dynamic batch size, like the decode step."""
    compiled = torch.compile(_moe_layer, fullgraph=True, mode="reduce-overhead", dynamic=True)
    for tokens in (16, 48):
        inputs = moe_inputs(tokens, 64, 512, 256, 4, device="cuda")
        eager = ops.fused_moe(*inputs)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(*inputs)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


@cuda
@pytest.mark.parametrize("step", ["router", "fused_moe", "router+fused_moe"])
def test_pdl_decode_in_cuda_graph(step, monkeypatch):
    """With ``QLLM_PDL`` on, at one token of Qwen3.5-35B-A3B (the slot path): the router, the
    experts (gate-up then down), and the router feeding the experts, eagerly and in a CUDA
    graph replayed 100 times, give the bits of PDL off."""
    require_pdl_gpu()
    experts, top_k, hidden, inter = GPU_SHAPES["35b-a3b"]
    inputs = moe_inputs(1, experts, hidden, inter, top_k, device="cuda")
    logits = router_logits(1, experts, torch.bfloat16, "cuda")  # [1, E + 1]

    def routed() -> torch.Tensor:
        weights, ids = ops.moe_router(logits, top_k, True)  # [1, k + 1] each
        return ops.fused_moe(*inputs._replace(topk_weights=weights, topk_ids=ids))

    steps = {"router": lambda: ops.moe_router(logits, top_k, True),
             "fused_moe": lambda: ops.fused_moe(*inputs), "router+fused_moe": routed}
    assert_graph_bits_equal(steps[step], monkeypatch)


@cuda
def test_opcheck_cuda():
    opcheck_op("cuda", torch.bfloat16)


# ----------------------------------------------------------------------------- CPU

def _naive_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The expected padded slot list and block experts, one expert at a time."""
    flat = topk_ids.flatten().tolist()
    slots, experts = [], []
    for e in range(num_experts):
        mine = [s for s, expert in enumerate(flat) if expert == e]
        if mine:
            mine += [len(flat)] * (-len(mine) % block_m)
            slots += mine
            experts += [e] * (len(mine) // block_m)
    return slots, experts


# name -> (tokens, experts, top_k, skew)
ALIGN_CASES = {
    "t1-e8-k2": (1, 8, 2, 0.0), "t7-k=e": (7, 8, 8, 0.0), "t64-e256-k8": (64, 256, 8, 0.0),
    "t33-skewed": (33, 6, 2, 10.0), "t300-e16": (300, 16, 4, 0.0),
    "t1-e256-skewed": (1, 256, 8, 10.0), "t200-e256-k8": (200, 256, 8, 0.0),
    "t512-e256-k8": (512, 256, 8, 0.0),
    # past triton_align.MAX_SLOTS: counted in chunks of CHUNK slots
    "t600-e256-k8": (600, 256, 8, 0.0), "t1500-e16-skewed": (1500, 16, 4, 10.0),
}
align_cases = pytest.mark.parametrize("tokens,experts,top_k,skew", ALIGN_CASES.values(),
                                      ids=ALIGN_CASES.keys())


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("block_m", [1, 4, 16])
@align_cases
def test_moe_align(tokens, experts, top_k, skew, block_m, id_dtype):
    topk_ids = moe_inputs(tokens, experts, 8, 8, top_k, skew=skew).topk_ids.to(id_dtype)
    experts += 1  # the shared expert's slot: expert E
    num_slots = tokens * (top_k + 1)
    slots, block_experts, num_blocks = moe_align(topk_ids, experts, block_m)
    padded = max_padded_slots(num_slots, experts, block_m)
    assert slots.shape == (padded,) and block_experts.shape == (padded // block_m,)

    used = int(num_blocks) * block_m
    expected_slots, expected_experts = _naive_layout(topk_ids, experts, block_m)
    assert slots[:used].tolist() == expected_slots
    assert block_experts[:int(num_blocks)].tolist() == expected_experts
    assert (slots[used:] == num_slots).all()  # the unused tail is padding

    valid = slots[slots < num_slots]
    assert sorted(valid.tolist()) == list(range(num_slots))  # every slot exactly once
    block_of = torch.arange(padded) // block_m
    in_use = slots < num_slots
    assert (topk_ids.flatten()[slots[in_use]] == block_experts[block_of[in_use]]).all()


def check_triton_align(tokens, experts, top_k, skew, block_m, device) -> None:
    """The Triton align gives the torch ``moe_align``'s output on the blocks in use."""
    from qllm_kernels_moe.triton_align import moe_align_triton

    topk_ids = moe_inputs(tokens, experts, 8, 8, top_k, skew=skew).topk_ids.to(device)
    experts += 1  # the shared expert's slot: expert E
    slots, block_experts, num_blocks = moe_align_triton(topk_ids, experts, block_m)
    expected = moe_align(topk_ids, experts, block_m)
    assert torch.equal(block_experts, expected.block_experts)
    assert torch.equal(num_blocks, expected.num_blocks)
    used = int(num_blocks) * block_m
    assert torch.equal(slots[:used], expected.slots[:used])


@cuda
@pytest.mark.parametrize("block_m", [16, 64])
@align_cases
def test_triton_align(tokens, experts, top_k, skew, block_m):
    check_triton_align(tokens, experts, top_k, skew, block_m, "cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@router_cases
def test_router(tokens, experts, top_k, renormalize, dtype):
    check_router(tokens, experts, top_k, renormalize, dtype, "cuda")


def test_max_padded_slots_is_reached():
    """The bound is tight: 5 slots over 4 experts, one expert twice, blocks of 4 -> 16."""
    topk_ids = torch.tensor([[0], [0], [1], [2], [3]])
    assert max_padded_slots(5, 4, 4) == 16
    assert int(moe_align(topk_ids, 4, 4).num_blocks) * 4 == 16
    assert max_padded_slots(2, 256, 16) == 32  # fewer slots than experts


def test_slot_counters_grow_keeping_the_old_buffer():
    """The persistent kernel's counters grow (doubled) when a launch needs more, and the buffer
    before stays alive: CUDA graphs captured before the growth still point at it."""
    from qllm_kernels_moe.triton_slot_moe import _counters, _slot_counters

    device = torch.device("meta")  # a device of its own, away from the other tests' buffers
    first = _slot_counters(device, 3)
    assert first.numel() == 256 and _slot_counters(device, 255) is first
    grown = _slot_counters(device, 256)
    assert grown.numel() == 514 and grown is not first
    assert _counters[device][0] is first and _slot_counters(device, 9) is grown


def test_config_table():
    table = load_table(256, 1024, 2048)
    assert table is not None and list(table) == sorted(table)
    for config in table.values():
        assert config.BLOCK_M in (1, 16, 32, 64, 128)
        for gemm in (config.up, config.down):
            assert gemm.BLOCK_N >= (1 if config.BLOCK_M == 1 else 16) and gemm.BLOCK_K >= 16
            assert gemm.num_warps in (1, 2, 4, 8) and 1 <= gemm.num_stages <= 6
    assert get_config(1, 256, 1024, 2048, 8) == table[1]
    assert get_config(3, 256, 1024, 2048, 8) == table[4]
    assert get_config(100_000, 256, 1024, 2048, 8) == table[max(table)]
    assert load_table(3, 48, 32) is None
    assert get_config(7, 3, 48, 32, 2) == default_config(7, 3, 2)
    assert default_config(1, 256, 8).BLOCK_M < default_config(4096, 256, 8).BLOCK_M


def _moe_layer(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2):
    """How the model calls the registered kernel (``Experts.forward``)."""
    return ops.fused_moe(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2)


def test_compile_fullgraph_on_fake_path():
    """Dynamo and AOT autograd trace the op into one graph, with a symbolic token count as in
    the decode step, and the fake gives the output (meta tensors: no kernel runs)."""

    def run(backend):
        compiled = torch.compile(_moe_layer, fullgraph=True, dynamic=True, backend=backend)
        for tokens in (5, 7):  # not k + 1 = 3: Dynamo would tie the two sizes
            inputs = [t.to("meta") for t in moe_inputs(tokens, 8, 32, 16, 2)]
            out = compiled(*inputs)
            assert out.device.type == "meta" and out.shape == (tokens, 3, 32)  # 2 + shared
            assert out.dtype == torch.bfloat16

    (graph,) = graphs_traced_by(run)  # one graph for both token counts
    assert called_ops(graph) == [torch.ops.qllm_moe.fused_moe.default]


def test_router_compiles_fullgraph_on_fake_path():
    def route(logits):
        weights, ids = ops.moe_router(logits, 4, True)
        return weights * 2, ids

    def run(backend):
        compiled = torch.compile(route, fullgraph=True, dynamic=True, backend=backend)
        for tokens in (3, 5):
            weights, ids = compiled(torch.empty(tokens, 17, dtype=torch.bfloat16,
                                                device="meta"))
            assert weights.shape == ids.shape == (tokens, 5)
            assert weights.dtype == torch.bfloat16 and ids.dtype == torch.int64

    (graph,) = graphs_traced_by(run)
    assert torch.ops.qllm_moe.moe_router.default in called_ops(graph)


def test_plugin_registration():
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    kernels = registry.kernels(torch.device("cuda"), torch.bfloat16)
    for op in ("fused_moe", "moe_router"):
        assert kernels.names()[op] == ("triton" if HAS_TRITON else "torch")
    if HAS_TRITON:
        assert kernels.fused_moe is ops.fused_moe and kernels.moe_router is ops.moe_router
    for device, dtype in (("cpu", torch.bfloat16), ("cuda", torch.float32)):
        names = registry.kernels(torch.device(device), dtype).names()
        assert names["fused_moe"] == names["moe_router"] == "torch"


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _pdl_launch(op: str):
    """The launch of the router or of the experts (the slot path: gate-up, then down, or
    ``fused_moe-persistent``, both in one kernel) at one token of Qwen3.5-35B-A3B, on ``meta``
    tensors."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton
    from qllm_kernels_moe.triton_router import moe_router_triton

    experts, top_k, hidden, inter = GPU_SHAPES["35b-a3b"]
    if op == "router":
        return lambda: moe_router_triton(_meta(1, experts + 1), top_k, True)
    inputs = MoeInputs(_meta(1, hidden), _meta(experts, 2 * inter, hidden),
                       _meta(experts, hidden, inter), _meta(1, top_k + 1),
                       _meta(1, top_k + 1, dtype=torch.int64), _meta(2 * inter, hidden),
                       _meta(hidden, inter))
    config = MoeConfig(1, GemmConfig(1, 2048, num_stages=1), GemmConfig(4, 512), 8) \
        if op == "fused_moe-persistent" else None
    return lambda: fused_moe_triton(*inputs, config=config)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("op", ["router", "fused_moe", "fused_moe-persistent"])
def test_pdl_sass(op, monkeypatch):
    """The router's kernel and the slot path's two, compiled for sm_90 as launched: with PDL
    each waits before any store, the router at entry, the gate-up after reading the shared
    expert's first tile, and it lets the down launch only after its wait (the persistent
    kernel, as the gate-up); the down reads its ids and weights first
    (``qllm.testing.pdl.assert_pdl_sass``); without, no grid-dependency-control
    instruction."""
    assert_pdl_sass(_pdl_launch(op), monkeypatch, reads_before_wait=op != "router",
                    releases_after_wait={"_slot_gate_up_kernel", "_slot_moe_kernel"})


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_prefetch_down_sass():
    """The slot gate-up of the one-token entry, compiled for sm_90 as launched, with and
    without ``prefetch_down``: with it, an L2 prefetch (CCTL) and no more registers (its
    residency unchanged); without, none."""
    from qllm.testing.sm90 import (captured_launches, compile_for_sm90, resource_usage,
                                   sass_instructions, sm90_compiler_missing)
    from qllm_kernels_moe.triton_slot_moe import slot_gate_up

    if sm90_compiler_missing():
        pytest.skip(sm90_compiler_missing())
    experts, top_k, hidden, inter = GPU_SHAPES["35b-a3b"]
    up = load_table(experts, 2 * inter, hidden)[1].up
    x, w13, shared_w13 = _meta(1, hidden), _meta(experts, 2 * inter, hidden), \
        _meta(2 * inter, hidden)
    ids = _meta(1, top_k + 1, dtype=torch.int64)
    down_weights = (_meta(experts, hidden, inter), _meta(hidden, inter))
    compiled = {}
    for prefetch in (None, down_weights):
        (launch,) = captured_launches(lambda: slot_gate_up(x, w13, shared_w13, ids, up,
                                                           prefetch))
        kernel = compile_for_sm90(launch.kernel, launch.args, launch.options)
        opcodes = [opcode for _, opcode, _ in sass_instructions(kernel)]
        compiled[prefetch is not None] = (resource_usage(kernel), opcodes)
    (plain, plain_ops), (prefetching, prefetching_ops) = compiled[False], compiled[True]
    assert not any(op.startswith("CCTL") for op in plain_ops)
    assert "CCTL.E.PML2" in prefetching_ops, sorted(set(prefetching_ops))
    assert prefetching["registers"] <= plain["registers"] and not prefetching["spill_bytes"]


test_triton_interpreter = interpreter_driver(__file__)


# The interpreter's tl.dot reads bf16 as raw integers, so these use fp16 and fp32.
@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("config", TINY_CONFIGS.values(), ids=TINY_CONFIGS.keys())
@pytest.mark.parametrize("case", TINY.values(), ids=TINY.keys())
def test_interpreted_parity(case, config, dtype):
    tokens, experts, top_k, hidden, inter, skew = case
    check_parity(moe_inputs(tokens, experts, hidden, inter, top_k, dtype, skew=skew), config)


@interpreted
@pytest.mark.parametrize("case", TINY.values(), ids=TINY.keys())
def test_interpreted_slot_path_bf16(case):
    """The small-batch path has no ``tl.dot``, so the interpreter runs it in bf16 too."""
    tokens, experts, top_k, hidden, inter, skew = case
    inputs = moe_inputs(tokens, experts, hidden, inter, top_k, torch.bfloat16, skew=skew)
    check_parity(inputs, TINY_CONFIGS["m1"])


@interpreted
@pytest.mark.parametrize("config", LOOPED_CONFIGS.values(), ids=LOOPED_CONFIGS.keys())
@pytest.mark.parametrize("case", LOOPED_CASES.values(), ids=LOOPED_CASES.keys())
def test_interpreted_slot_path_looped(case, config):
    """The gate-up's programs computing every so many tiles (``programs_per_sm``), the tile
    after the first read while the one before is reduced, or both GEMMs in one persistent
    kernel; with the shared expert in each token's last slot and, in the next test, its
    first."""
    tokens, experts, top_k, hidden, inter, skew = case
    check_parity(moe_inputs(tokens, experts, hidden, inter, top_k, torch.float32, skew=skew),
                 config)


@interpreted
@pytest.mark.parametrize("case,config", [
    *[pytest.param(case, "m1", id=f"{name}-m1") for name, case in TINY.items()],
    *[pytest.param(case, config, id=f"{name}-{config}") for name, case in LOOPED_CASES.items()
      for config in ("m1-looped", "m1-persistent")]])
def test_interpreted_slot_path_shared_expert_not_last(case, config):
    """Each token's shared expert in its first slot, a routed one in its last: the slot
    kernels' guess (the last slot is the shared expert's) is wrong everywhere, and the result
    is still the reference's."""
    tokens, experts, top_k, hidden, inter, skew = case
    inputs = moe_inputs(tokens, experts, hidden, inter, top_k, torch.float32, skew=skew)
    order = [top_k, *range(top_k)]  # the shared slot first
    inputs = inputs._replace(topk_weights=inputs.topk_weights[:, order].contiguous(),
                             topk_ids=inputs.topk_ids[:, order].contiguous())
    check_parity(inputs, {**TINY_CONFIGS, **LOOPED_CONFIGS}[config])


@interpreted
@pytest.mark.parametrize("block_m", [1, 16, 64])
@align_cases
def test_interpreted_triton_align(tokens, experts, top_k, skew, block_m):
    check_triton_align(tokens, experts, top_k, skew, block_m, "cpu")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@router_cases
def test_interpreted_router(tokens, experts, top_k, renormalize, dtype):
    check_router(tokens, experts, top_k, renormalize, dtype, "cpu")


@interpreted
def test_interpreted_opcheck():
    opcheck_op("cpu", torch.float16)
