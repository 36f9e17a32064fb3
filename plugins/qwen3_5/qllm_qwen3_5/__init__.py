"""qllm plugin for hybrid Qwen3.5 (dense / MoE) and Qwen3-Next models."""
