"""qllm plugin for dense Qwen3 models."""
