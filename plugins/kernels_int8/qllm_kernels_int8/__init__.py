"""8-bit weight formats for qllm (``int8``: W8A16 with a scale per output channel; ``fp8``:
e4m3 with 128x128 block scales, Qwen's FP8 checkpoints), registered through the
``qllm_weight_formats`` and ``qllm_kernels`` hooks (see ``plugin.py``)."""
