"""Token sampling kernel for qllm's ``sample_tokens`` op, registered through the
``qllm_kernels`` hook (see ``plugin.py``)."""
