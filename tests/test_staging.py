"""``qllm.runner.staging``: a step's integer inputs as views of one buffer."""

from __future__ import annotations

import torch

from qllm.runner.staging import ALIGNMENT, stage

CPU = torch.device("cpu")


def test_fields_round_trip_as_views_of_one_aligned_buffer():
    buffer, views, layout = stage({"ids": ([5, 6, 7], torch.int64),
                                   "lens": ([1, 2, 3], torch.int32),
                                   "tables": ([[1, 2], [3, 4], [5, 6]], torch.int32),
                                   "flags": ([True, False, True], torch.bool),
                                   "empty": ([], torch.int64)}, CPU)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert views["ids"].tolist() == [5, 6, 7] and views["ids"].dtype == torch.int64
    assert views["lens"].tolist() == [1, 2, 3] and views["lens"].dtype == torch.int32
    assert views["tables"].shape == (3, 2) and views["tables"].tolist() == [[1, 2], [3, 4],
                                                                            [5, 6]]
    assert views["flags"].tolist() == [True, False, True]
    assert views["empty"].numel() == 0
    assert list(layout) == ["ids", "lens", "tables", "flags", "empty"]
    assert layout["tables"][2:] == (torch.int32, torch.Size([3, 2]))
    base = buffer.data_ptr()
    for view in views.values():
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert (view.data_ptr() - base) % ALIGNMENT == 0
    views["lens"][0] = 9  # a write through a view lands in the buffer
    offset = views["lens"].data_ptr() - base
    assert buffer[offset:offset + 4].view(torch.int32).tolist() == [9]


def test_more_fields_extend_the_same_layout():
    """A decode step's staged buffer (pending-token fields last) starts with the layout of a
    graph's static buffer, so one copy of its head refreshes the graph's inputs."""
    common = {"ids": ([1, 2], torch.int64), "lens": ([3, 4], torch.int32)}
    zeros = {name: ([0] * len(v), d) for name, (v, d) in common.items()}
    static, static_views, static_layout = stage(zeros, CPU)
    step, _, layout = stage({**common, "pending": ([1], torch.int64)}, CPU)
    assert step.numel() > static.numel()
    assert {name: layout[name] for name in static_layout} == static_layout
    static.copy_(step[:static.numel()])
    assert static_views["ids"].tolist() == [1, 2] and static_views["lens"].tolist() == [3, 4]
