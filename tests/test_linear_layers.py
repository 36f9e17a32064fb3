"""The ``linear`` op: the core registers ``F.linear`` for it, and every dense projection of the
models (attention, Gated DeltaNet, dense MLP, the LM head) runs through the chosen kernel; the
MoE input projection through the chosen ``add_rms_norm_linear`` (the norm before it fused)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qllm import LLM, SamplingParams
from qllm.plugins.hookspecs import hookimpl
from qllm.layers.linear import Linear, PackedLinear
from qllm.ops import linear as reference
from qllm.plugins.registry import PluginRegistry
from qllm.plugins.specs import KernelSpec
from qllm.testing import save_tiny_qwen3


class RecordingLinear:
    """A plugin whose ``linear`` and ``add_rms_norm_linear`` kernels outrank every other and
    record each call's ``(weight, bias)`` (``None`` for the fused op's projection) before
    computing the references."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.fused_calls: list[torch.Tensor] = []  # add_rms_norm_linear's weights

    @hookimpl
    def qllm_kernels(self):
        return [KernelSpec(op="linear", name="recording", fn=self.linear, priority=100),
                KernelSpec(op="add_rms_norm_linear", name="recording",
                           fn=self.add_rms_norm_linear, priority=100)]

    def linear(self, x, weight, bias):
        self.calls.append((weight, bias))
        return F.linear(x, weight, bias)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, zero_centered, weight):
        self.fused_calls.append(weight)
        return reference.add_rms_norm_linear(x, residual, norm_weight, eps, zero_centered,
                                             weight)


def test_reference_is_registered_as_the_builtin_kernel():
    kernels = PluginRegistry(load_entry_points=False).kernels(torch.device("cpu"),
                                                              torch.float32)
    assert kernels.linear is reference.linear and kernels.names()["linear"] == "torch"


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_layers_call_the_chosen_kernel(bias):
    recorder = RecordingLinear()
    kernels = PluginRegistry([recorder], load_entry_points=False).kernels(
        torch.device("cpu"), torch.float32)
    packed = PackedLinear(8, {"a": 3, "b": 2}, kernels, bias=bias, row_multiple=4)
    for layer, out_features in ((Linear(8, 5, kernels, bias=bias), 5), (packed, 8)):
        x = torch.randn(2, 3, 8)
        out = layer(x)
        assert out.shape == (2, 3, out_features)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
        assert recorder.calls[-1][0] is layer.weight and recorder.calls[-1][1] is layer.bias
        assert (layer.bias is not None) == bias


def _checkpoint(kind: str, path):
    """A tiny checkpoint of ``kind`` in ``path`` and the model plugin that serves it."""
    if kind == "qwen3-bias":
        plugin = pytest.importorskip("qllm_qwen3.plugin")
        save_tiny_qwen3(path, attention_bias=True)
    else:
        plugin = pytest.importorskip("qllm_qwen3_5.plugin")
        pytest.importorskip("qllm_qwen3_5.testing").save_checkpoint(kind, str(path))
    return str(path), plugin


@pytest.mark.parametrize("kind", ["qwen3-bias", "qwen3_next"])
def test_model_projections_run_through_the_linear_op(kind, tmp_path):
    """Prefill and a decode step of a tiny model: every ``nn.Linear`` is a ``Linear`` of the
    chosen kernel, and each one the forward uses (all but the shared expert's, whose weights
    the ``fused_moe`` op reads) reaches the kernel with its own weight and bias, as does the
    LM head; the MoE input projections reach the chosen ``add_rms_norm_linear`` instead.
    Qwen3-Next has every kind of projection: GDN and gated attention layers, dense and MoE
    MLPs."""
    path, model_plugin = _checkpoint(kind, tmp_path)
    recorder = RecordingLinear()
    registry = PluginRegistry([recorder, model_plugin], load_entry_points=False)
    llm = LLM(path, plugins=registry, max_model_len=64, num_kv_blocks=16, block_size=16)
    assert llm.engine.kernels.names()["linear"] == "recording"
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)

    linears = {name: m for name, m in llm.engine.model.named_modules()
               if isinstance(m, nn.Linear)}
    assert linears and all(isinstance(m, Linear) for m in linears.values())
    calls = {id(weight): bias for weight, bias in recorder.calls}
    fused = {id(weight) for weight in recorder.fused_calls}
    used = {name for name, m in linears.items() if id(m.weight) in calls}
    moe_inputs = {name for name in linears if name.endswith(".mlp.input_proj")}
    assert used == {name for name in linears
                    if ".shared_expert." not in name and name not in moe_inputs}
    assert {name for name in moe_inputs if id(linears[name].weight) in fused} == moe_inputs
    assert bool(moe_inputs) == (kind == "qwen3_next")
    assert all(calls[id(linears[name].weight)] is linears[name].bias for name in used)
    head = llm.engine.model.lm_head.weight
    assert id(head) in calls and calls[id(head)] is None
    if kind == "qwen3-bias":
        assert linears["model.layers.0.self_attn.o_proj"].bias is not None
