"""GEMV kernel for qllm's ``linear`` op at a few rows, registered through the ``qllm_kernels``
hook (see ``plugin.py``) as the ``qllm_linear::linear`` custom op."""
