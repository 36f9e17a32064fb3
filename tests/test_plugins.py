"""The plugin registry: built-ins registered through the hooks, duplicate registrations,
kernels checked against their op's contract, and choosing kernels by priority or by the
``kernels=`` pin."""

from __future__ import annotations

import pytest
import torch

from qllm.ops.attention import kv_store
from qllm.ops.contracts import CORE_OPS
from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.registry import (DuplicateRegistrationError, KernelContractError, PluginRegistry,
                          default_registry)
from qllm.plugins.specs import KernelSpec

CPU = torch.device("cpu")


class FastKvStore:
    """A stand-in plugin: a higher-priority ``kv_store`` that only claims CUDA, and one that
    claims every device."""

    @hookimpl
    def qllm_kernels(self):
        return [KernelSpec(op="kv_store", name="cuda-only", fn=kv_store, priority=20,
                           is_available=lambda device, dtype: device.type == "cuda"),
                KernelSpec(op="kv_store", name="anywhere", fn=kv_store, priority=10)]


def registry(*plugins) -> PluginRegistry:
    return PluginRegistry(extra_plugins=plugins, load_entry_points=False)


def test_builtins_serve_every_core_op_with_its_reference():
    kernels = registry().kernels(CPU, torch.float32)
    assert kernels.names() == {op.name: "torch" for op in CORE_OPS}
    assert all(getattr(kernels, op.name) is op.reference for op in CORE_OPS)


def test_every_installed_kernel_takes_its_op_reference_parameters():
    """Every installed kernel, available here or not (the CUDA ones on a CPU machine too), is
    checked against its op's reference when kernels are chosen."""
    assert default_registry().kernels(CPU, torch.float32).names()


class WrongFusedMoe:
    """An out-of-tree kernel plugin whose ``fused_moe`` drops the shared expert's weights and
    names a parameter its own way."""

    @hookimpl
    def qllm_kernels(self):
        def fused_moe(x, w13, w2, weights, topk_ids):
            return x

        return [KernelSpec(op="fused_moe", name="mine", fn=fused_moe, priority=30,
                           is_available=lambda device, dtype: device.type == "cuda")]


def test_kernel_with_a_wrong_signature_fails_at_start_up():
    """Unavailable on this device, and still refused: the error names the kernel, its op, its
    plugin and how its parameters differ from the reference's."""
    with pytest.raises(KernelContractError, match=(
            r"kernel 'mine' of op 'fused_moe' from plugin WrongFusedMoe does not take the "
            r"op's parameters: it takes \(x, w13, w2, weights, topk_ids\), the reference "
            r"qllm\.ops\.moe\.fused_moe takes \(x, w13, w2, topk_weights, topk_ids, "
            r"shared_w13, shared_w2\): missing \['topk_weights', 'shared_w13', 'shared_w2'\]; "
            r"unexpected \['weights'\]")):
        registry(WrongFusedMoe()).kernels(CPU, torch.float32)


def test_kernel_of_an_op_without_a_reference_is_refused():
    class Orphan:
        @hookimpl
        def qllm_kernels(self):
            return [KernelSpec(op="warp_drive", name="fast", fn=kv_store)]

    with pytest.raises(KernelContractError, match=r"op 'warp_drive' \(kernels \['fast'\] "
                                                  r"from \['Orphan'\]\) has no reference"):
        registry(Orphan()).kernels(CPU, torch.float32)


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
