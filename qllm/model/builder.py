"""From a checkpoint directory to a loaded model on its device."""

from __future__ import annotations

import json
import logging
import os

import torch

from qllm.config import EngineConfig
from qllm.distributed.parallel_state import get_tp
from qllm.model.loader import (checkpoint_dtypes, checkpoint_files, init_dummy_weights,
                         iterate_checkpoint, load_weights)
from qllm.model.causal_lm import CausalLM
from qllm.model.quantization import resolve_weight_format
from qllm.plugins.registry import Kernels, PluginRegistry

logger = logging.getLogger(__name__)


def read_architectures(model_dir: str) -> list[str]:
    """``architectures`` from ``config.json``, with a clear error when it is missing or bad."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    architectures = raw.get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"{path} has no 'architectures' list; cannot tell which model it is")
    return architectures


def load_hf_config(model_dir: str, plugins: PluginRegistry):
    """The transformers config, after checking that some plugin serves its architecture."""
    plugins.model_spec(read_architectures(model_dir))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def build_model(config: EngineConfig, hf_config, plugins: PluginRegistry, kernels: Kernels,
                device: torch.device) -> CausalLM:
    """Build on the meta device, materialise on ``device`` in ``config.dtype``, then load the
    checkpoint (or dummy weights) straight into the device tensors. A weight format
    (``qllm.model.quantization``: ``config.quantization`` or the checkpoint's own
    ``quantization_config``) swaps its modules in on the meta device, after the cast to
    ``config.dtype``, and maps and post-processes the checkpoint's tensors."""
    spec = plugins.model_spec(hf_config.architectures)
    weight_format = resolve_weight_format(plugins, config.quantization, hf_config, config,
                                          kernels)
    logger.info("building %s from %s%s", spec.architecture, spec.plugin,
                f", weights {weight_format.name}" if weight_format else "")
    dummy = config.load_format == "dummy"
    tp = get_tp()
    if weight_format is not None and tp.size > 1:
        raise ValueError(f"weights {weight_format.name} are not supported with "
                         f"tensor_parallel_size > 1 yet")
    files = None if dummy else checkpoint_files(config.model)
    with torch.device("meta"):
        model = spec.build(hf_config, kernels, config)
    model = model.to(config.dtype)
    if weight_format is not None:
        weight_format.replace_modules(model, kernels, None if dummy else checkpoint_dtypes(files))
    model = model.to_empty(device=device)
    model.tie_weights()
    model.reset_derived_buffers()
    if dummy:
        init_dummy_weights(model, config.seed)
    else:
        # a tensor-parallel rank reads only its shard of each tensor
        weights = iterate_checkpoint(files, device, progress=tp.rank == 0, lazy=tp.size > 1)
        if weight_format is not None:
            weights = weight_format.map_checkpoint(model, weights)
        load_weights(model, weights)
    if weight_format is not None:
        weight_format.process_weights_after_loading(model)
    return model.eval()
