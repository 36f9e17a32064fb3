"""Every hook a qllm plugin can implement.

Plugins are discovered through the ``qllm`` entry-point group; each entry point names a module
(or object) holding ``@hookimpl`` functions. The core's own cache kinds, layer kinds and
plain-torch kernels register through these same hooks (see ``qllm/plugins/builtins.py``).

Collecting hooks return lists of small frozen specs (``qllm.plugins.specs``). All of them are called
once, when the engine is built; ``forward`` never consults the plugin manager.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "qllm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def qllm_models():
    """Return a list of ``ModelSpec``: HF ``architectures`` strings and the builder for each.

    Called once when an ``LLM`` resolves ``config.json``'s ``architectures``. Two plugins
    serving the same architecture string is an error.
    """


@hookspec
def qllm_cache_kinds():
    """Return a list of ``CacheKindSpec``: named per-sequence memory kinds.

    A cache kind owns one pool (KV blocks, recurrent slots...), sized by the cache registry
    from the layers that need it, and tells the scheduler whether a sequence fits. The pool (a
    ``qllm.cache.base.CachePool``) also owns what the rest of the engine must not guess about
    the kind: what each sequence holds, the kind's fields of every step's ``ForwardBatch``
    (``batch.caches[name]``), the inert padding unit that padded CUDA-graph rows use, and the
    check that one sequence of ``max_model_len`` tokens fits. Called once per engine. Built
    in: ``paged_kv`` and ``recurrent_slot``.
    """


@hookspec
def qllm_layer_kinds():
    """Return a list of ``LayerKindSpec``: which cache kind a kind of layer reads and writes.

    Built in: ``full_attention`` -> ``paged_kv``, ``linear_attention`` -> ``recurrent_slot``.
    Called once per engine, before the cache registry sizes its pools.
    """


@hookspec
def qllm_kernels():
    """Return a list of ``KernelSpec``: implementations of named ops.

    For each op the highest-priority implementation whose ``is_available(device, dtype)`` is
    true is chosen once, when the model is built. The core registers the plain-torch
    reference of each of its ops (``qllm.ops.contracts``) at priority 0; GPU plugins register
    faster ones at higher priority, taking the reference's parameters (checked then).
    """


@hookspec
def qllm_weight_formats():
    """Return a list of ``WeightFormatSpec``: named weight formats (quantization methods).

    Called once when an engine resolves ``EngineConfig.quantization`` (``LLM(...,
    quantization=NAME)``, ``--quantization NAME``) or a checkpoint's own
    ``quantization_config`` (its ``quant_method`` is looked up in each spec's
    ``checkpoint_methods``). The chosen spec's ``create`` makes a ``qllm.model.quantization.
    WeightFormat``, which swaps modules of the meta-device model before it is materialised,
    maps checkpoint tensors (weights, scales) onto the swapped modules while loading, and
    post-processes them after; the swapped modules call the ops the format names in
    ``WeightFormatSpec.ops`` (registered through ``qllm_kernels`` like any op). The core knows
    no format by name; two plugins registering one name is an error.
    """
