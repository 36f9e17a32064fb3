"""Registers ``LlamaForCausalLM`` with qllm (the ``qllm_models`` hook)."""

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import ModelSpec


def build(hf_config, kernels, engine_config):
    """Called on the meta device; the core materialises the module and loads its weights."""
    from qllm_example_llama.model import LlamaForCausalLM

    return LlamaForCausalLM(hf_config, kernels, engine_config)


@hookimpl
def qllm_models():
    return [ModelSpec(architecture="LlamaForCausalLM", build=build,
                      plugin="qllm-example-llama")]
