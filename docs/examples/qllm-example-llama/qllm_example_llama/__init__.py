"""The plugin guide's example model plugin (``docs/plugins.md``): Llama for qllm."""
