"""A step's integer inputs staged in one buffer, so that they reach the device in one copy.

A step feeds the model about ten small tensors: token ids, positions and the ``ForwardBatch``'s
metadata. Copied one by one they were ten host-to-device copies per step, and a CUDA-graph
replay then copied each into the graph's static inputs: twenty-odd copies of a few
microseconds each in a 3 ms batch-1 decode step. ``stage`` packs them into one pinned byte
buffer on the host, copies it to the device once, and returns views of the device copy. A
decode graph's static inputs are views of such a buffer too, laid out alike, so a replay
refreshes all of them with one device-to-device copy of the buffer.
"""

from __future__ import annotations

import torch

from qllm.batch import Layout

# bytes: every field starts 16-byte aligned (the buffer itself comes from the caching
# allocator, 512-byte aligned), as Inductor's kernels assume of their inputs; a view at an
# offset of 8 would be copied to an aligned tensor before each compiled call
ALIGNMENT = 16




def _views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    return {name: buffer[offset:offset + nbytes].view(dtype).view(shape)
            for name, (offset, nbytes, dtype, shape) in layout.items()}


def stage(fields: dict[str, tuple[list, torch.dtype]], device: torch.device
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Layout]:
    """``fields``: name -> (values, dtype); values a flat list or a list of equal-length lists.

    Returns ``(buffer, views, layout)``: the ``uint8`` buffer on ``device``, each field as a
    tensor viewing it, and where each lies (name -> offset, bytes, dtype, shape). The layout
    follows the fields in order, so two calls with the same names, dtypes and shapes lay
    their buffers out alike, and a call with more fields after those extends the layout. One
    host-to-device copy, non-blocking from pinned memory on CUDA.
    """
    tensors = {name: torch.tensor(values, dtype=dtype) for name, (values, dtype) in fields.items()}
    layout: Layout = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        layout[name] = (size, nbytes, tensor.dtype, tensor.shape)
        size += -(-nbytes // ALIGNMENT) * ALIGNMENT
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for name, view in _views(host, layout).items():
        view.copy_(tensors[name])
    buffer = host.to(device, non_blocking=True)
    return buffer, _views(buffer, layout), layout
