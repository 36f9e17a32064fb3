"""The qllm-kernels-moe plugin against the plain-torch ``fused_moe`` (``qllm.ops.moe``).

- CUDA (skipped without a GPU): bf16 parity for T in {1, 7, 64, 256, 2048} at the
  Qwen3.5-35B-A3B shape and two smaller ones, skewed routing, every entry of the shipped
  block-size table, forced configs, fp16, CUDA-graph replay, compiled decode, ``opcheck``, the
  Triton sort against ``moe_align`` and the Triton router against ``moe_router``; the
  one-launch slot kernel (``QLLM_MOE_SLOT=fused``, ``triton_slot_fused``) at the 35B-A3B shape
  for 1-4 tokens with every candidate config, against the reference and the two-kernel path,
  bit-equal run to run and in CUDA-graph replays, its counters left zero.
- CPU: the sort (``moe_align``) against a naive layout, the config tables, the custom op's
  fake path under ``torch.compile(fullgraph=True)``, the plugin's registration, and, under the
  Triton interpreter, the Triton align against ``moe_align``, the router against
  ``moe_router`` and parity at tiny shapes (the one-launch slot kernel too, 1-4 tokens, bf16,
  fp16, fp32); the one-launch slot kernel compiled offline for sm_90 (registers, no spills,
  its ``w2`` tile loaded before its wait) by the installed Triton. The interpreter must be
  switched on before Triton is imported, so ``test_triton_interpreter`` reruns this file's
  ``interpreted`` tests in a subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("qllm_kernels_moe")

# after the skips above, so the suite runs where the plugin is not installed
from qllm.testing.kernels import (HAS_TRITON, called_ops, cuda, graphs_traced_by,  # noqa: E402
                                  interpreted, interpreter_driver, run_interpreted_tests)
from qllm.ops import moe as reference  # noqa: E402
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm_kernels_moe import ops, plugin  # noqa: E402
from qllm_kernels_moe.align import max_padded_slots, moe_align  # noqa: E402
from qllm_kernels_moe.configs import (FUSED_SLOT_CANDIDATES, FusedSlotConfig,  # noqa: E402
                                      GemmConfig, MoeConfig, default_config, get_config,
                                      load_table)
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
    "m16": MoeConfig(16, GemmConfig(16, 32), GemmConfig(32, 16, 2)),
    "m32": MoeConfig(32, GemmConfig(32, 16, 4), GemmConfig(16, 32)),
}


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


def _check_compiled_decode_matches_eager(token_counts, *shape: int) -> None:
    """``fused_moe`` under a ``fullgraph`` CUDA-graph compile with a dynamic batch size, like
    the decode step, bit-equal to eager at each of ``token_counts`` (``moe_inputs``'s
    ``shape`` after the token count)."""
    compiled = torch.compile(_moe_layer, fullgraph=True, mode="reduce-overhead", dynamic=True)
    for tokens in token_counts:
        inputs = moe_inputs(tokens, *shape, device="cuda")
        eager = ops.fused_moe(*inputs)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(*inputs)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


@cuda
def test_compiled_decode_matches_eager():
    _check_compiled_decode_matches_eager((16, 48), 64, 512, 256, 4)


@cuda
def test_opcheck_cuda():
    opcheck_op("cuda", torch.bfloat16)


# ----------------------------------------------------------------------------- one-launch slot

FUSED_TOKENS = (1, 2, 3, 4)
FUSED_CANDIDATES = pytest.mark.parametrize(
    "config", FUSED_SLOT_CANDIDATES,
    ids=["u{}x{}-d{}-w{}-s{}".format(*dataclasses.astuple(c)) for c in FUSED_SLOT_CANDIDATES])


@pytest.fixture
def slot_mode_fused(monkeypatch):
    """The op's small-batch path on the one-launch kernel, as ``QLLM_MOE_SLOT=fused`` would
    set it at import."""
    from qllm_kernels_moe import triton_slot_fused

    monkeypatch.setattr(triton_slot_fused, "SLOT_MODE", "fused")


def counters_zero(device_type: str) -> bool:
    """Every workspace of the one-launch kernel on devices of ``device_type`` is back to
    zero."""
    from qllm_kernels_moe.triton_slot_fused import _WORKSPACES

    return all(not counters.any() for device, workspaces in _WORKSPACES.items()
               if device.type == device_type for counters in workspaces)


def check_fused(inputs: MoeInputs, config: FusedSlotConfig | None = None) -> torch.Tensor:
    """The one-launch kernel against the reference; its counters are left zero."""
    from qllm_kernels_moe.triton_slot_fused import slot_moe_fused

    out = slot_moe_fused(*inputs, config=config).view(*inputs.topk_ids.shape, -1)
    _assert_close(out, _reference(inputs), inputs.x.dtype)
    assert counters_zero(inputs.x.device.type)
    return out


@cuda
@pytest.mark.parametrize("skew", [0.0, 10.0], ids=["random", "skewed"])
@pytest.mark.parametrize("tokens", FUSED_TOKENS, ids=lambda n: f"t{n}")
def test_fused_slot_parity(slot_mode_fused, tokens, skew):
    """Through the op (its table config picks the small-batch path) at Qwen3.5-35B-A3B's
    shape: 256 experts, top-8 plus the shared expert, hidden 2048, expert size 512."""
    inputs = moe_inputs(tokens, 256, 2048, 512, 8, device="cuda", skew=skew)
    check_parity(inputs)
    assert counters_zero("cuda")


@cuda
@FUSED_CANDIDATES
@pytest.mark.parametrize("tokens", [1, 4], ids=lambda n: f"t{n}")
def test_fused_slot_configs(config, tokens):
    """Every candidate the benchmark times, at 35B-A3B's shape, and at a shape whose expert
    size (96) is no power of two nor a multiple of the row tiles (fp16)."""
    check_fused(moe_inputs(tokens, 256, 2048, 512, 8, device="cuda"), config)
    check_fused(moe_inputs(tokens, 8, 256, 96, 2, torch.float16, "cuda"), config)


@cuda
@pytest.mark.parametrize("tokens", FUSED_TOKENS, ids=lambda n: f"t{n}")
def test_fused_slot_matches_split(tokens):
    """The same arithmetic as the two-kernel path (``hidden`` rounded to bf16 in both): the
    outputs agree to the order of the last sums."""
    from qllm_kernels_moe.triton_moe import fused_moe_triton
    from qllm_kernels_moe.triton_slot_fused import slot_moe_fused

    inputs = moe_inputs(tokens, 256, 2048, 512, 8, device="cuda")
    split = fused_moe_triton(*inputs).view(tokens * 9, -1)
    fused = slot_moe_fused(*inputs)
    torch.testing.assert_close(fused.float(), split.float(), atol=4e-3, rtol=1e-2)


@cuda
def test_fused_slot_deterministic_in_graph_replays():
    """Bit-equal run to run, eagerly and in a CUDA graph replayed 50 times as the routing and
    the activations change in place (a replay's counters are zero for the next one)."""
    from qllm_kernels_moe.triton_slot_fused import slot_moe_fused

    inputs = moe_inputs(4, 256, 2048, 512, 8, device="cuda")
    first = slot_moe_fused(*inputs)
    for _ in range(20):
        assert torch.equal(slot_moe_fused(*inputs), first)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = slot_moe_fused(*inputs)
    for seed in range(50):
        new = moe_inputs(4, 256, 2048, 512, 8, device="cuda", seed=seed, skew=seed % 3 * 5.0)
        for name in ("x", "topk_weights", "topk_ids"):
            getattr(inputs, name).copy_(getattr(new, name))
        graph.replay()
        assert torch.equal(out, slot_moe_fused(*inputs)), seed
    _assert_close(out.view(4, 9, -1), _reference(inputs), torch.bfloat16)
    assert counters_zero("cuda")


@cuda
def test_fused_slot_many_launches():
    """2,000 launches back to back (no sync between), 1 and 4 tokens alternating: none
    hangs, the last results equal the first, the counters end at zero."""
    from qllm_kernels_moe.triton_slot_fused import slot_moe_fused

    inputs = [moe_inputs(tokens, 256, 2048, 512, 8, device="cuda", seed=tokens)
              for tokens in (1, 4)]
    expected = [slot_moe_fused(*i) for i in inputs]
    outs = [slot_moe_fused(*inputs[n % 2]) for n in range(2000)]
    torch.cuda.synchronize()
    assert torch.equal(outs[-2], expected[0]) and torch.equal(outs[-1], expected[1])
    assert counters_zero("cuda")


@cuda
def test_fused_slot_compiled_decode_matches_eager(slot_mode_fused):
    """The same at the one-launch path's token counts and 35B-A3B's shape."""
    _check_compiled_decode_matches_eager((3, 4), 256, 2048, 512, 8)


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


def test_config_table():
    table = load_table(256, 1024, 2048)
    assert table is not None and list(table) == sorted(table)
    for config in table.values():
        assert config.BLOCK_M in (1, 16, 32, 64, 128)
        for gemm in (config.up, config.down):
            assert gemm.BLOCK_N >= (1 if config.BLOCK_M == 1 else 16) and gemm.BLOCK_K >= 16
            assert gemm.num_warps in (2, 4, 8) and 1 <= gemm.num_stages <= 6
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


def test_slot_mode_from_env(monkeypatch):
    from qllm_kernels_moe.triton_slot_fused import slot_mode_from_env

    for value, mode in (("fused", "fused"), ("Fused", "fused"), ("split", "split"),
                        ("", "split")):
        monkeypatch.setenv("QLLM_MOE_SLOT", value)
        assert slot_mode_from_env() == mode
    monkeypatch.delenv("QLLM_MOE_SLOT")
    assert slot_mode_from_env() == "split"
    monkeypatch.setenv("QLLM_MOE_SLOT", "one")
    with pytest.raises(ValueError, match="QLLM_MOE_SLOT"):
        slot_mode_from_env()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@FUSED_CANDIDATES
@pytest.mark.parametrize("tokens", [1, 4], ids=lambda n: f"t{n}")
def test_fused_slot_sass(config, tokens):
    """The one-launch kernel as launched at 35B-A3B's shape, compiled for sm_90 by the
    installed Triton (the H200 image's 3.6 and CI's 3.7 both checked): no spills, at most
    168 registers (3 programs of 4 warps per SM), and the down task's ``w2`` tile loaded
    before its wait (ptxas sinks loads below volatile polls unless a barrier holds them)."""
    import triton

    from qllm.testing.sm90 import sm90_compiler_missing
    from qllm_kernels_moe import testing

    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    summary = testing.sass_summary(testing.compile_fused_slot(tokens, config))
    before, after = testing.fused_slot_prefetch(summary["sass"])
    where = (f"triton {triton.__version__}: {summary['registers']} registers, "
             f"{summary['spill_bytes']} spilled, loads {before} before the wait, {after} after")
    assert summary["spill_bytes"] == 0 and summary["registers"] <= 168, where
    tile_loads = config.DOWN_ROWS * 512 * 2 // (16 * 32 * config.num_warps)  # 16-byte loads
    assert before >= tile_loads and after == 0, where


@interpreter_driver
def test_triton_interpreter():
    """Runs the ``interpreted`` tests below on the CPU, in a subprocess with the interpreter."""
    run_interpreted_tests(__file__)


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


# name -> (tokens, experts, top_k, hidden, intermediate, skew); top_k + 1 slots per token
TINY_FUSED = {
    "t1-e8-k2": (1, 8, 2, 32, 16, 0.0),
    "t2-e8-k2-h48-i24": (2, 8, 2, 48, 24, 0.0),  # partial row tiles, I no power of two
    "t3-e6-k2-skewed": (3, 6, 2, 32, 16, 10.0),  # experts shared between slots
    "t4-e16-k4": (4, 16, 4, 64, 32, 0.0),
}
TINY_FUSED_CONFIGS = {"u4x16-d8-w2": FusedSlotConfig(4, 16, 8, 2),
                      "u16x32-d32-w4": FusedSlotConfig(16, 32, 32, 4)}


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("config", TINY_FUSED_CONFIGS.values(), ids=TINY_FUSED_CONFIGS.keys())
@pytest.mark.parametrize("case", TINY_FUSED.values(), ids=TINY_FUSED.keys())
def test_interpreted_fused_slot(case, config, dtype):
    """The one-launch kernel (no ``tl.dot``: bf16 runs too), the shared expert in every
    token's last slot; its counters are back to zero after."""
    tokens, experts, top_k, hidden, inter, skew = case
    check_fused(moe_inputs(tokens, experts, hidden, inter, top_k, dtype, skew=skew), config)


@interpreted
@pytest.mark.parametrize("tokens", FUSED_TOKENS, ids=lambda n: f"t{n}")
def test_interpreted_fused_slot_through_op(slot_mode_fused, tokens):
    """``QLLM_MOE_SLOT=fused``: the op's small-batch path takes the one launch (its default
    config), and the sorted path beyond is untouched."""
    from qllm_kernels_moe import triton_slot_fused

    calls = []
    fused = triton_slot_fused.slot_moe_fused
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_slot_fused, "slot_moe_fused",
                      lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))
        check_parity(moe_inputs(tokens, 8, 32, 16, 2, torch.bfloat16, seed=tokens))
        check_parity(moe_inputs(7, 8, 32, 16, 2, torch.float16))  # 7 tokens: sorted path
    assert calls == [1]
    assert counters_zero("cpu")
