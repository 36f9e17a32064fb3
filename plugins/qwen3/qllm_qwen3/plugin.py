"""Registers ``Qwen3ForCausalLM`` with qllm."""

from qllm.hookspecs import hookimpl
from qllm.specs import ModelSpec


def _build(hf_config, kernels, engine_config):
    from qllm_qwen3.model import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config, kernels, engine_config)


@hookimpl
def qllm_models():
    return [ModelSpec(architecture="Qwen3ForCausalLM", build=_build, plugin="qllm-qwen3")]
