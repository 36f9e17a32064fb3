"""Fused-MoE kernel for qllm: sorted token slots and two grouped Triton GEMMs, registered
through the ``qllm_kernels`` hook (see ``plugin.py``) as the ``qllm_moe::fused_moe`` custom op."""
