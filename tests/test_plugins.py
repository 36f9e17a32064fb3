"""The plugin registry: built-ins registered through the hooks, duplicate registrations, and
choosing kernels by priority or by the ``kernels=`` pin."""

from __future__ import annotations

import pytest
import torch

from qllm.hookspecs import hookimpl
from qllm.plugins import DuplicateRegistrationError, PluginRegistry, default_registry
from qllm.specs import KernelSpec
from qllm.testing.kernels import kernel_parameters

CPU = torch.device("cpu")


class FastKvStore:
    """A stand-in plugin: a higher-priority ``kv_store`` that only claims CUDA, and one that
    claims every device."""

    @hookimpl
    def qllm_kernels(self):
        return [KernelSpec(op="kv_store", name="cuda-only", fn=lambda *a: None, priority=20,
                           is_available=lambda device, dtype: device.type == "cuda"),
                KernelSpec(op="kv_store", name="anywhere", fn=lambda *a: None, priority=10)]


def registry(*plugins) -> PluginRegistry:
    return PluginRegistry(extra_plugins=plugins, load_entry_points=False)


def test_builtins_serve_every_op_with_plain_torch():
    names = registry().kernels(CPU, torch.float32).names()
    assert {"kv_store", "paged_attention_decode", "paged_attention_prefill"} <= set(names)
    assert set(names.values()) == {"torch"}


def test_every_kernel_takes_its_op_reference_parameters():
    """Each installed kernel of an op is called as the op's plain-torch reference (the
    implementation named ``torch``) is: same parameter names, same order. (An op whose
    reference is in a plugin not installed here is not checked.)"""
    specs = [spec for specs in default_registry().manager.hook.qllm_kernels() for spec in specs]
    references = {spec.op: kernel_parameters(spec.fn) for spec in specs if spec.name == "torch"}
    checked = [spec for spec in specs if spec.op in references]
    mismatched = {f"{spec.op}/{spec.name}": kernel_parameters(spec.fn) for spec in checked
                  if kernel_parameters(spec.fn) != references[spec.op]}
    assert not mismatched, f"kernels whose parameters differ from the reference's: {mismatched}"


def test_highest_priority_available_kernel_wins():
    assert registry(FastKvStore()).kernels(CPU, torch.float32).names()["kv_store"] == "anywhere"


def test_pinned_kernel_overrides_priority():
    kernels = registry(FastKvStore()).kernels(CPU, torch.float32, {"kv_store": "torch"})
    assert kernels.names()["kv_store"] == "torch"


@pytest.mark.parametrize("pin, message", [
    ({"kv_sotre": "torch"}, r"no op named \['kv_sotre'\]"),
    ({"kv_store": "triton"}, r"kv_store='triton' is not registered; available here: "
                             r"\['anywhere', 'torch'\]"),
    ({"kv_store": "cuda-only"}, r"kv_store='cuda-only' is not available on cpu"),
])
def test_bad_pin_names_the_problem(pin, message):
    with pytest.raises(ValueError, match=message):
        registry(FastKvStore()).kernels(CPU, torch.float32, pin)


def test_duplicate_kernel_name_raises():
    class Clash:
        @hookimpl
        def qllm_kernels(self):
            return [KernelSpec(op="kv_store", name="torch", fn=lambda *a: None)]

    with pytest.raises(DuplicateRegistrationError, match="'torch'"):
        registry(Clash()).kernels(CPU, torch.float32)


def test_llm_accepts_a_kernel_pin(qwen3_dir):
    from qllm import LLM, SamplingParams

    llm = LLM(qwen3_dir, kernels={"kv_store": "torch"}, max_model_len=64)
    assert llm.engine.kernels.names()["kv_store"] == "torch"
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0]["token_ids"]) == 3
    with pytest.raises(ValueError, match="no op named"):
        LLM(qwen3_dir, kernels={"nope": "torch"}, max_model_len=64)
