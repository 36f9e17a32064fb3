"""Build a model from a checkpoint directory: safetensors (single or sharded) or dummy weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from qllm.distributed.shards import CheckpointSlice
from qllm.layers.linear import default_weight_loader
from qllm.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"{index_path} lists shards that do not exist: {missing}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir} "
                              f"(pass load_format='dummy' for random weights)")
    return [os.path.join(model_dir, f) for f in files]


def iterate_checkpoint(files: list[str], device: torch.device, progress: bool = True,
                       lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, read straight onto ``device``; with
    ``lazy``, ``(name, CheckpointSlice)`` instead, read by the weight loader (a
    tensor-parallel rank reads only its shard of each)."""
    for path in tqdm(files, desc="Loading safetensors", unit="file",
                     disable=not progress or len(files) < 2):
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if lazy:
                        handle = f.get_slice(name)
                        yield name, CheckpointSlice(handle, handle.get_shape())
                    else:
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read {path}: it is corrupt or truncated ({exc})") \
                from exc


def checkpoint_dtypes(files: list[str]) -> dict[str, torch.dtype]:
    """Each checkpoint tensor's dtype, read from the safetensors headers (no tensor data)."""
    dtypes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    dtypes[name] = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read {path}: it is corrupt or truncated ({exc})") \
                from exc
    return dtypes


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def resolve_name(model: CausalLM, ckpt_name: str) -> tuple[str, str | None] | None:
    """The ``(parameter name, shard)`` a checkpoint tensor loads into (``shard`` ``None``:
    the whole parameter), or ``None`` when the model does not use it: ``checkpoint_name``,
    then ``packed_modules``."""
    name = model.checkpoint_name(ckpt_name)
    if name is None:
        return None
    # checkpoint_name may name the shard itself, e.g. ("...experts.down_proj.weight", "3")
    return name if isinstance(name, tuple) else _apply_packing(model, name)


def load_weights(model: CausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``; every parameter must be filled exactly once."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = set()
    for name in params:
        owner = modules[name.rpartition(".")[0]]
        shards = getattr(owner, "shard_offsets", None) or [None]
        expected |= {(name, shard) for shard in shards}
    loaded: set[tuple[str, str | None]] = set()
    skipped = 0
    for ckpt_name, tensor in weights:
        resolved = resolve_name(model, ckpt_name)
        if resolved is None:
            skipped += 1
            continue
        name, shard = resolved
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"unexpected tensor {ckpt_name!r} in the checkpoint: the model "
                                  f"has no parameter {name!r}")
        owner = modules[name.rpartition(".")[0]]
        try:
            if shard is None:
                getattr(owner, "weight_loader", default_weight_loader)(param, tensor)
            else:
                owner.weight_loader(param, tensor, shard)
        except ValueError as exc:
            raise CheckpointError(f"tensor {ckpt_name!r}: {exc}") from exc
        loaded.add((name, shard))
    # a sharded parameter may also come whole (e.g. fused expert tensors)
    missing = sorted(f"{n}" + (f" ({s} shard)" if s else "") for n, s in expected - loaded
                     if (n, None) not in loaded)
    if missing:
        raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    if skipped:
        logger.info("skipped %d checkpoint tensors the model does not use", skipped)


def _apply_packing(model: CausalLM, name: str) -> tuple[str, str | None]:
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in model.packed_modules:
            fused, shard = model.packed_modules[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return name, None


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights (as vLLM's ``--load-format dummy``): matrices ~ N(0, 0.02),
    vectors (norms, biases, gates) ~ 1 + U(-0.01, 0.01) — enough for speed runs at real
    geometry without a checkpoint. A parameter of a 1-byte dtype (int8 / fp8 weights of a
    weight format) gets such a matrix in fp32 through its module's ``weight_loader``, which
    quantizes it."""
    modules = dict(model.named_modules())
    for index, (name, param) in enumerate(sorted(model.named_parameters())):
        generator = torch.Generator(device=param.device).manual_seed(seed * 100003 + index)
        if param.element_size() == 1:
            matrix = torch.empty(param.shape, device=param.device).normal_(
                0.0, 0.02, generator=generator)
            modules[name.rpartition(".")[0]].weight_loader(param, matrix)
        elif param.dim() >= 2:
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.uniform_(0.99, 1.01, generator=generator)
