"""Checkpoint tensors read in part: a tensor-parallel rank loads only its shard.

With ``tensor_parallel_size > 1`` the loader yields each safetensors tensor as a
``CheckpointSlice`` (nothing read yet); a sharded layer's weight loader ``narrow``s it to the
rank's rows or columns and ``materialize`` reads just those bytes (safetensors' ``get_slice``).
A plain tensor takes the same calls (``narrow`` is a view), so one loader serves both.
"""

from __future__ import annotations

import torch


class CheckpointSlice:
    """A not-yet-read checkpoint tensor, or a box of it: ``shape``, ``dim()``, ``narrow``
    as a tensor's, and ``materialize()`` to read the box. Valid while its file is open: the
    loader hands it to one weight loader, which reads it before returning."""

    def __init__(self, handle, shape, box: tuple[slice, ...] | None = None):
        self._handle = handle  # safetensors' PySafeSlice
        self.shape = torch.Size(shape)
        self._box = box or tuple(slice(0, n) for n in self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "CheckpointSlice":
        dim = dim % len(self.shape)
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"cannot narrow dim {dim} of shape {tuple(self.shape)} to "
                             f"[{start}, {start + length})")
        base = self._box[dim].start + start
        box = self._box[:dim] + (slice(base, base + length),) + self._box[dim + 1:]
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointSlice(self._handle, shape, box)

    def materialize(self) -> torch.Tensor:
        return self._handle[self._box]


def materialize(loaded) -> torch.Tensor:
    """The tensor of ``loaded``: itself, or a ``CheckpointSlice``'s box read from disk."""
    return loaded.materialize() if isinstance(loaded, CheckpointSlice) else loaded


def narrow_part(loaded, dim: int, parts: int, index: int):
    """Part ``index`` of ``parts`` equal parts of ``loaded`` along ``dim``."""
    size = loaded.shape[dim]
    if size % parts:
        raise ValueError(f"dim {dim} of shape {tuple(loaded.shape)} does not split into "
                         f"{parts} equal parts")
    step = size // parts
    return loaded.narrow(dim, index * step, step)


def narrow_sections(loaded, dim: int, sections: list[int], parts: int, index: int) -> list:
    """``loaded`` holds ``sections`` back to back along ``dim`` (e.g. the q, k, v channels of
    a GDN conv); part ``index`` of ``parts`` of each."""
    if sum(sections) != loaded.shape[dim]:
        raise ValueError(f"dim {dim} of shape {tuple(loaded.shape)} is not the sections "
                         f"{sections} back to back")
    out, start = [], 0
    for size in sections:
        out.append(narrow_part(loaded.narrow(dim, start, size), dim, parts, index))
        start += size
    return out
