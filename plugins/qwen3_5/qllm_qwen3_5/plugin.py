"""Registers the hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next architectures with qllm. The ops
their layers call, the MoE layers' ``moe_router`` and ``fused_moe`` included, are the core's
(``qllm.ops.contracts``)."""

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import ModelSpec

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

