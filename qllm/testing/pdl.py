"""The programmatic-dependent-launch tests' shared checks (``qllm.plugins.pdl``): the switch
forced on or off, where a kernel's SASS compiled for sm_90 waits (``gdc_summary``,
``assert_pdl_sass``), and, on a GPU, a CUDA graph replayed with PDL against the bits without
(``assert_graph_bits_equal``).
"""

from __future__ import annotations

import sys
from typing import Callable, Collection

import pytest
import torch

from qllm.testing.sm90 import (SASS_INSTRUCTION, captured_launches, compile_for_sm90, cuobjdump,
                               resource_usage, sm90_compiler_missing)

# SASS opcodes (before the first ``.``) that reach global memory, and that branch or end a thread
GLOBAL_LOADS = {"LDG", "LD", "LDGSTS", "UTMALDG", "UBLKCP"}
GLOBAL_STORES = {"STG", "ST", "RED", "REDG", "ATOM", "ATOMG", "UTMASTG", "UTMAREDG", "UBLKRED"}
CONTROL = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BREAK", "KILL"}
WAIT, LAUNCH_DEPENDENTS = "ACQBULK", "PREEXIT"  # griddepcontrol.wait, .launch_dependents
# ``pdl_enter`` at kernel entry, in ``gdc_summary``'s terms: nothing reaches memory before the
# wait, and the kernel does not spill
WAIT_AT_ENTRY = dict(spill_bytes=0, waits=1, launch_dependents=1, wait_unpredicated=True,
                     launch_dependents_first=True, loads_before_wait=[], stores_before_wait=[],
                     control_before_wait=[])


def force_pdl(monkeypatch: pytest.MonkeyPatch, on: bool, anywhere: bool = False) -> None:
    """Switch PDL on or off as ``QLLM_PDL`` would, on at any row count; with ``anywhere``, on
    every device too (the ``meta`` tensors of a launch captured for ``compile_for_sm90``)."""
    from qllm.plugins import pdl

    monkeypatch.setattr(pdl, "PDL", on)
    monkeypatch.setattr(pdl, "PDL_MAX_ROWS", sys.maxsize)
    if anywhere:
        monkeypatch.setattr(pdl, "pdl_available", lambda device: True)


def require_pdl_gpu() -> None:
    """Skip where the GPU cannot launch with PDL (or there is none)."""
    from qllm.plugins import pdl

    if not (torch.cuda.is_available() and pdl.pdl_available(torch.device("cuda"))):
        pytest.skip("programmatic dependent launch needs a GPU of compute capability 9.0")


def gdc_summary(compiled) -> dict:
    """Where the grid-dependency-control instructions lie in the SASS of a kernel compiled by
    ``compile_for_sm90``: how many ``griddepcontrol.wait`` (``ACQBULK``) and
    ``.launch_dependents`` (``PREEXIT``) it holds; whether the first wait is unpredicated and
    whether the launch of dependents comes before it; the global loads (opcodes with their
    modifiers, e.g. ``LDG.E.EF.128``), global stores and atomics, and branches or exits before
    it (with none of the last, every thread of every program runs the wait); the global loads
    after it; and the bytes the kernel spills."""
    found = [(predicate.strip(), opcode) for _, predicate, opcode, _ in
             SASS_INSTRUCTION.findall(cuobjdump(compiled.asm["cubin"], "-sass"))]
    opcodes = [opcode for _, opcode in found]
    waits = [i for i, opcode in enumerate(opcodes) if opcode == WAIT]
    launches = [i for i, opcode in enumerate(opcodes) if opcode == LAUNCH_DEPENDENTS]
    first = waits[0] if waits else len(found)
    before, after = opcodes[:first], opcodes[first + 1:]

    def of(kinds: set[str], opcodes: list[str]) -> list[str]:
        return [opcode for opcode in opcodes if opcode.split(".")[0] in kinds]

    return dict(
        spill_bytes=resource_usage(compiled)["spill_bytes"],
        waits=len(waits), launch_dependents=len(launches),
        wait_unpredicated=bool(waits) and not found[first][0],
        launch_dependents_first=bool(launches) and launches[0] < first,
        loads_before_wait=of(GLOBAL_LOADS, before), stores_before_wait=of(GLOBAL_STORES, before),
        control_before_wait=of(CONTROL, before), loads_after_wait=of(GLOBAL_LOADS, after))


def sass_summaries(launch: Callable[[], object], on: bool, monkeypatch: pytest.MonkeyPatch,
                   named: bool = False) -> list:
    """``gdc_summary`` of each kernel ``launch()`` launches (an op's launcher on ``meta``
    tensors), with PDL forced ``on`` or off, compiled for sm_90 by the installed Triton (skips
    where it cannot compile offline); with ``named``, ``(kernel function name, summary)``
    pairs."""
    missing = sm90_compiler_missing()
    if missing:
        pytest.skip(missing)
    force_pdl(monkeypatch, on, anywhere=True)
    launches = captured_launches(launch)
    assert launches, "no Triton kernel launched"
    for kernel_launch in launches:
        assert kernel_launch.args["USE_PDL"] is on
        assert kernel_launch.options.get("launch_pdl", False) is on
    summaries = [gdc_summary(compile_for_sm90(*kernel_launch)) for kernel_launch in launches]
    if not named:
        return summaries
    return [(kernel_launch.kernel.fn.__name__, summary)
            for kernel_launch, summary in zip(launches, summaries, strict=True)]


def assert_pdl_sass(launch: Callable[[], object], monkeypatch: pytest.MonkeyPatch,
                    reads_before_wait: bool = False,
                    releases_after_wait: Collection[str] = ()) -> None:
    """Each kernel ``launch()`` launches, compiled for sm_90: with PDL, one launch of dependents
    then one unpredicated wait (the other way round in the kernels named in
    ``releases_after_wait``), with no global load (some, with ``reads_before_wait``: a kernel
    that reads its parameters, slots or state first), store, atomic, branch or exit before it,
    loads after it and no spill; without, neither instruction."""
    for kernel, summary in sass_summaries(launch, True, monkeypatch, named=True):
        expected = dict(WAIT_AT_ENTRY, loads_before_wait=summary["loads_before_wait"],
                        launch_dependents_first=kernel not in releases_after_wait)
        assert {key: summary[key] for key in WAIT_AT_ENTRY} == expected, (kernel, summary)
        assert bool(summary["loads_before_wait"]) == reads_before_wait, (kernel, summary)
        assert summary["loads_after_wait"], (kernel, summary)
    for summary in sass_summaries(launch, False, monkeypatch):
        assert summary["waits"] == summary["launch_dependents"] == 0, summary


def assert_graph_bits_equal(step: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]],
                            monkeypatch: pytest.MonkeyPatch, replays: int = 100,
                            reset: Callable[[], None] = lambda: None) -> None:
    """``step()`` with PDL on, eagerly and captured in a CUDA graph replayed ``replays`` times,
    gives the bits of ``step()`` eagerly with PDL off; ``reset()`` runs before each (restoring
    any state ``step`` updates in place, so every run starts alike)."""
    force_pdl(monkeypatch, False)
    reset()
    reference = tuple(out.clone() for out in _as_tuple(step()))  # a state returned is reused
    force_pdl(monkeypatch, True)
    reset()
    _assert_equal(_as_tuple(step()), reference, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _as_tuple(step())
    for replay in range(replays):
        reset()
        graph.replay()
        _assert_equal(out, reference, f"replay {replay}")


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _assert_equal(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...],
                  where: str) -> None:
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(got, want), f"{where}: output {index} differs from PDL off"
