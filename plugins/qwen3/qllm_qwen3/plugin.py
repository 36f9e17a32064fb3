"""Registers ``Qwen3ForCausalLM`` and ``Qwen3ASRForConditionalGeneration`` (Qwen3-ASR: an
audio encoder before the Qwen3 decoder) with qllm."""

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import ModelSpec


def _build(hf_config, kernels, engine_config):
    from qllm_qwen3.model import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config, kernels, engine_config)


def _build_asr(hf_config, kernels, engine_config):
    from qllm_qwen3.asr import Qwen3ASRForConditionalGeneration

    return Qwen3ASRForConditionalGeneration(hf_config, kernels, engine_config)


@hookimpl
def qllm_models():
    return [ModelSpec(architecture="Qwen3ForCausalLM", build=_build, plugin="qllm-qwen3"),
            ModelSpec(architecture="Qwen3ASRForConditionalGeneration", build=_build_asr,
                      plugin="qllm-qwen3")]
