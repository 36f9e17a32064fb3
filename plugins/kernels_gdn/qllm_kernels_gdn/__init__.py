"""Gated DeltaNet kernels for qllm: Triton causal conv1d (prefill and update), a fused
recurrent gated delta rule that updates the slot state in place (decode, and a prefill
fallback), and fla's chunked gated delta rule for prefill, registered through the
``qllm_kernels`` hook (see ``plugin.py``) as ``qllm_gdn`` custom ops."""
