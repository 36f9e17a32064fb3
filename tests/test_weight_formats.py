"""The weight-format hook (``qllm_weight_formats``, ``qllm.model.quantization``) with a toy format
registered from outside the tree: a test-local plugin whose linears hold int16 weights in
units of 1/1024 and call its own op. End to end through ``LLM``, and the errors for unknown,
conflicting or unservable formats."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qllm import LLM
from qllm.layers.linear import Linear
from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.registry import PluginRegistry
from qllm.model.quantization import (UnknownWeightFormatError, WeightFormat, row_runs,
                               swap_modules)
from qllm.plugins.specs import KernelSpec, WeightFormatSpec
from qllm.testing import prefill_logits, require_qwen3_plugin

UNIT = 1024.0


def toy_linear(x, weight, bias):
    return F.linear(x, (weight.float() / UNIT).to(x.dtype), bias)


class ToyLinear(nn.Module):
    """``weight [N, K] int16 = round(w * 1024)``, rows placed as the replaced module would."""

    def __init__(self, layout: Linear, kernels):
        super().__init__()
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.bias = layout.bias
        self.shard_offsets = getattr(layout, "shard_offsets", None)
        self.split = layout.split if hasattr(layout, "split") else None
        object.__setattr__(self, "_layout", layout)
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features,
                                               dtype=torch.int16), requires_grad=False)
        self._linear = kernels.toy_linear
        self.processed = False

    def weight_loader(self, param, loaded, shard=None):
        assert param is self.weight, "the toy model has no biases"
        for src, dst, n in row_runs(self._layout, shard, loaded.shape[0], self.out_features):
            param.data[dst:dst + n] = torch.round(loaded[src:src + n].float() * UNIT)

    def process_weights_after_loading(self):
        self.processed = True

    def forward(self, x):
        return self._linear(x, self.weight, self.bias)


class ToyFormat(WeightFormat):
    name = "toy16"

    def __init__(self, quant_config):
        self.quant_config = quant_config
        self.seen_checkpoint = None

    def replace_modules(self, model, kernels, checkpoint):
        self.seen_checkpoint = checkpoint
        swap_modules(model, lambda name, m: ToyLinear(m, kernels)
                     if isinstance(m, Linear) else None)


class ToyPlugin:
    """Registers the ``toy16`` format (also loading checkpoints marked ``quant_method:
    toy16``) and the op its modules call."""

    def __init__(self):
        self.formats = []

    @hookimpl
    def qllm_weight_formats(self):
        def create(quant_config, engine_config):
            self.formats.append(ToyFormat(quant_config))
            return self.formats[-1]

        return [WeightFormatSpec(name="toy16", create=create, plugin="test-toy",
                                 checkpoint_methods=("toy16",), ops=("toy_linear",),
                                 description="int16 weights in 1/1024 units")]

    @hookimpl
    def qllm_kernels(self):
        return [KernelSpec(op="toy_linear", name="torch", fn=toy_linear)]


def _registry(*plugins) -> PluginRegistry:
    return PluginRegistry(extra_plugins=plugins, load_entry_points=False)


def _qwen3_registry(*plugins) -> PluginRegistry:
    from qllm_qwen3 import plugin as qwen3_plugin

    return _registry(qwen3_plugin, *plugins)


@pytest.fixture
def toy():
    require_qwen3_plugin()
    return ToyPlugin()


def test_toy_format_end_to_end(toy, qwen3_dir):
    """``quantization="toy16"`` swaps every projection, loads and post-processes it, and the
    model computes what the model with the rounded weights computes."""
    options = dict(dtype="float32", device="cpu", enforce_eager=True, warm_up=False)
    llm = LLM(qwen3_dir, plugins=_qwen3_registry(toy), quantization="toy16", **options)
    model = llm.engine.model
    toy_modules = [m for m in model.modules() if isinstance(m, ToyLinear)]
    assert len(toy_modules) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(m.processed for m in toy_modules)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert toy.formats[0].seen_checkpoint["model.layers.0.self_attn.q_proj.weight"] \
        == torch.float32
    base = LLM(qwen3_dir, plugins=_qwen3_registry(), **options)
    with torch.no_grad():  # the twin: the same weights, rounded to 1/1024
        for name, param in base.engine.model.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(torch.round(param * UNIT) / UNIT)
    prompt = list(range(3, 30))
    torch.testing.assert_close(prefill_logits(llm, prompt), prefill_logits(base, prompt),
                               atol=1e-5, rtol=1e-5)
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    from qllm import SamplingParams

    assert llm.generate([prompt], SamplingParams(**greedy))[0]["token_ids"] == \
        base.generate([prompt], SamplingParams(**greedy))[0]["token_ids"]


def _with_quant_config(src: str, dst, quant_config: dict) -> str:
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), dst / name)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_checkpoint_quantization_config_is_honoured(toy, qwen3_dir, tmp_path):
    path = _with_quant_config(qwen3_dir, tmp_path, {"quant_method": "toy16", "bits": 16})
    llm = LLM(path, plugins=_qwen3_registry(toy), dtype="float32", device="cpu",
              enforce_eager=True)
    assert toy.formats[-1].quant_config == {"quant_method": "toy16", "bits": 16}
    assert any(isinstance(m, ToyLinear) for m in llm.engine.model.modules())


def test_unknown_format_lists_the_known_ones(toy, qwen3_dir):
    with pytest.raises(UnknownWeightFormatError,
                       match=r"unknown quantization 'int4'.*'toy16' \(test-toy: int16"):
        LLM(qwen3_dir, plugins=_qwen3_registry(toy), quantization="int4", device="cpu")


def test_unknown_checkpoint_method(toy, qwen3_dir, tmp_path):
    path = _with_quant_config(qwen3_dir, tmp_path, {"quant_method": "awq"})
    with pytest.raises(UnknownWeightFormatError, match=r"quant_method='awq'.*'toy16'"):
        LLM(path, plugins=_qwen3_registry(toy), device="cpu")


def test_requested_format_must_match_the_checkpoint(toy, qwen3_dir, tmp_path):
    class Other(ToyPlugin):
        @hookimpl
        def qllm_weight_formats(self):
            return [WeightFormatSpec(name="other", create=ToyFormat, plugin="test-other")]

        @hookimpl
        def qllm_kernels(self):
            return []

    path = _with_quant_config(qwen3_dir, tmp_path, {"quant_method": "toy16"})
    with pytest.raises(ValueError, match=r"quantization='other'.*already stored quantized"):
        LLM(path, plugins=_qwen3_registry(toy, Other()), quantization="other", device="cpu")


def test_format_without_its_ops_is_refused(qwen3_dir):
    require_qwen3_plugin()

    class NoOps:
        @hookimpl
        def qllm_weight_formats(self):
            return [WeightFormatSpec(name="toy16", create=ToyFormat, plugin="test-noops",
                                     ops=("toy_linear",))]

    with pytest.raises(ValueError, match=r"'toy16' needs kernel ops \['toy_linear'\]"):
        LLM(qwen3_dir, plugins=_qwen3_registry(NoOps()), quantization="toy16", device="cpu")


def test_no_format_without_plugins():
    assert _registry().weight_formats == {}


def test_duplicate_format_name_raises():
    from qllm.plugins.registry import DuplicateRegistrationError

    with pytest.raises(DuplicateRegistrationError, match="weight format 'toy16'"):
        _ = _registry(ToyPlugin(), ToyPlugin()).weight_formats
