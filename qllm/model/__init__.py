"""The model side of the core: the ``CausalLM`` base class of model plugins (``causal_lm``),
building one from a checkpoint (``builder``, ``loader``, ``quantization``), the media inputs of
multimodal models (``multimodal``) and the built-in default checkpoint (``default_model``)."""
