"""Paged-attention kernels for qllm: Triton split-K decode and varlen prefill, registered
through the ``qllm_kernels`` hook (see ``plugin.py``) as ``torch.library`` custom ops."""
