"""Registers the hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next architectures with qllm, and the
plain-torch ``moe_router`` and ``fused_moe`` reference kernels their MoE layers call."""

from qllm.hookspecs import hookimpl
from qllm.specs import KernelSpec, ModelSpec

ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",     # text path only
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",  # text path only
    "Qwen3NextForCausalLM",
)


def _builder(architecture: str):
    def build(hf_config, kernels, engine_config):
        from qllm_qwen3_5.model import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(hf_config, kernels, engine_config, architecture)

    return build


@hookimpl
def qllm_models():
    return [ModelSpec(architecture=arch, build=_builder(arch), plugin="qllm-qwen3-5")
            for arch in ARCHITECTURES]


@hookimpl
def qllm_kernels():
    from qllm_qwen3_5.moe import fused_moe, moe_router

    return [KernelSpec(op="fused_moe", name="torch", fn=fused_moe),
            KernelSpec(op="moe_router", name="torch", fn=moe_router)]
