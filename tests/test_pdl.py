"""Programmatic dependent launch (``qllm.plugins.pdl``): the ``QLLM_PDL`` switch, the launch
arguments it gives (PDL stays off on the CPU), ``pdl_enter``'s SASS compiled for sm_90 (the
wait before any memory access with it, nothing without), and, on a Hopper GPU, a decode-like
chain through the kernel plugins (residual add + RMSNorm, the router-logits GEMV, the router,
the experts' two kernels, over again), every kernel PDL-launched, in a CUDA graph replayed many
times: the bits of PDL off. Each plugin's tests check its own kernels the same way."""

from __future__ import annotations

import pytest
import torch

from qllm.testing.kernels import HAS_TRITON, INTERPRETING, cuda

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qllm.plugins import pdl

    @triton.jit
    def _scale_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        """``dst = 2 * src`` over ``BLOCK`` elements, entered through ``pdl_enter``."""
        pdl.pdl_enter(USE_PDL)
        offsets = tl.arange(0, BLOCK)
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets) * 2)


def test_env_switches(monkeypatch):
    """``QLLM_PDL`` and the other switches: ``0`` off, ``1`` on, unset or empty the default;
    anything else refused, naming the variable."""
    from qllm.switches import env_switch

    monkeypatch.delenv("QLLM_PDL", raising=False)
    assert env_switch("QLLM_PDL") and not env_switch("QLLM_PDL", default=False)
    for value, expected in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv("QLLM_PDL", value)
        assert env_switch("QLLM_PDL") is expected
    for value in ("true", "2", "on", "false"):
        monkeypatch.setenv("QLLM_PDL", value)
        with pytest.raises(ValueError, match="QLLM_PDL='"):
            env_switch("QLLM_PDL")


def test_launch_arguments(monkeypatch):
    """With PDL: ``USE_PDL`` and ``launch_pdl``; without, ``USE_PDL=False`` and no option (the
    launch of a kernel without PDL). On the CPU, and under the interpreter on any device, PDL
    stays off whatever the switch says; by the switch it is on for launches of at most
    ``PDL_MAX_ROWS`` rows, and an explicit ``pdl`` overrides both."""
    assert pdl.launch_options(True) == dict(launch_pdl=True) and pdl.launch_options(False) == {}
    monkeypatch.setattr(pdl, "PDL", True)
    cpu, few, many = torch.device("cpu"), pdl.PDL_MAX_ROWS, pdl.PDL_MAX_ROWS + 1
    assert not pdl.use_pdl(cpu, 1) and pdl.pdl_arguments(cpu, 1) == dict(USE_PDL=False)
    if INTERPRETING:
        assert not pdl.pdl_available(torch.device("cuda"))
    monkeypatch.setattr(pdl, "pdl_available", lambda device: True)
    assert pdl.pdl_arguments(cpu, few) == dict(USE_PDL=True, launch_pdl=True)
    assert pdl.pdl_arguments(cpu, many) == dict(USE_PDL=False)
    assert not pdl.use_pdl(cpu, 1, pdl=False) and pdl.use_pdl(cpu, many, pdl=True)
    monkeypatch.setattr(pdl, "PDL", False)
    assert pdl.pdl_arguments(cpu, 1) == dict(USE_PDL=False) and pdl.use_pdl(cpu, 1, pdl=True)


def test_pdl_enter_sass(monkeypatch):
    """``pdl_enter`` (a ``triton.jit`` function whose intrinsics sit in a constexpr branch),
    compiled for sm_90: with ``USE_PDL``, ``PREEXIT`` then ``ACQBULK`` before the kernel's load
    and store; without, neither."""
    from qllm.testing.pdl import assert_pdl_sass

    def launch():
        src, dst = (torch.empty(128, device="meta") for _ in range(2))
        _scale_kernel[(1,)](src, dst, BLOCK=128, num_warps=1, **pdl.pdl_arguments(src.device, 1))

    assert_pdl_sass(launch, monkeypatch)


@cuda
def test_pdl_decode_chain_in_cuda_graph(monkeypatch):
    """Four layers of a Qwen3.5-35B-A3B decode step's MoE half at one token, every kernel one
    of the plugins' (add_rms_norm -> the router-logits GEMV -> the router -> the slot experts'
    gate-up and down -> the next layer's add_rms_norm, summing the nine slot outputs), with
    ``QLLM_PDL`` on, eagerly and in a CUDA graph replayed 200 times: the bits of PDL off."""
    from qllm.testing.pdl import assert_graph_bits_equal, require_pdl_gpu

    linear_ops = pytest.importorskip("qllm_kernels_linear.ops")
    moe_ops = pytest.importorskip("qllm_kernels_moe.ops")
    from qllm_kernels_linear.testing import QWEN3_5_35B_A3B_SHAPES, linear_inputs, norm_inputs
    from qllm_kernels_moe.testing import moe_inputs

    require_pdl_gpu()
    experts, top_k = 256, 8
    x, residual, norm_weight = norm_inputs(1, 2048, torch.bfloat16, "cuda", True)
    router_weight = linear_inputs(1, *QWEN3_5_35B_A3B_SHAPES["moe_input"], device="cuda").weight
    moe = moe_inputs(1, experts, 2048, 512, top_k, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        hidden, summed = x, residual  # [1, 2048], then the slot outputs [1, k + 1, 2048]
        for _ in range(4):
            normed, summed = linear_ops.add_rms_norm(hidden, summed, norm_weight, 1e-6, True)
            logits = linear_ops.linear(normed, router_weight, None)[:, :experts + 1]
            weights, ids = moe_ops.moe_router(logits, top_k, True)  # [1, k + 1] each
            hidden = moe_ops.fused_moe(normed, moe.w13, moe.w2, weights, ids, moe.shared_w13,
                                       moe.shared_w2)
        return linear_ops.add_rms_norm(hidden, summed, norm_weight, 1e-6, True)

    assert_graph_bits_equal(step, monkeypatch, replays=200)
