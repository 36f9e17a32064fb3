"""When a PDL-launched kernel starts, against the triggers of the kernel before it.

Programmatic dependent launch (``qllm.plugins.pdl``) lets a kernel launch once every program of
the kernel before it has let it (``pdl_release``) or exited. In W3's decode step the slot MoE's
down is launched so after the gate-up, whose programs release right after their own wait (for
the router), yet every profile shows the down starting only 2-5 us before the gate-up ends,
however few the gate-up's programs (2026-12-07, H100: even 264, two per SM, all resident and
released ~5 us into a ~20 us gate-up). This harness isolates the question in a CUDA graph, as
the engine replays a step, with three kernels each stamping the GPU's global timer:

- ``first`` (one program): releases, waits, spins ``--first-us``;
- ``middle`` (``--programs`` programs, ``--warps`` warps): releases before its wait or after it
  (``--release``), stamps when it released, spins ``--middle-us``, stamps its end;
- ``last`` (one program): releases, stamps its entry, waits.

Per case one JSON line: ``last`` 's entry after ``middle`` 's last release
(``entry_after_release_us``: about a launch latency where the trigger works), after ``first`` 's
end and after ``middle`` 's first program ended (``entry_after_first_end_us``: near zero where
the dependent in fact waits for the primary's programs to exit), and the spread of the releases.
Medians over ``--replays`` replays of the graph. With ``--profile``, one more replay under
``torch.profiler`` also says when the profiler saw ``last`` start, against ``middle``'s end
(``profiler_start_after_middle_end_us``), beside the stamps' same interval of that replay:
whether a decode step's profile shows a PDL launch where it happens.

    python benchmarks/bench_pdl_launch.py [--programs 132 264 1056 4608] [--release after before]
        [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_available, pdl_enter, pdl_release, pdl_wait


@triton.jit
def _now():
    """The GPU's global timer, ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin(duration_ns):
    """Busy-wait ``duration_ns``; returns the time it ended."""
    start = _now()
    now = start
    while now - start < duration_ns:
        now = _now()
    return now


@triton.jit
def _first_kernel(stamps_ptr, duration_ns, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tl.store(stamps_ptr, _spin(duration_ns))  # stamps[0]: the end


@triton.jit
def _middle_kernel(stamps_ptr, duration_ns, RELEASE_BEFORE_WAIT: tl.constexpr,
                   USE_PDL: tl.constexpr):
    if RELEASE_BEFORE_WAIT:
        pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    if not RELEASE_BEFORE_WAIT:
        pdl_release(USE_PDL)
    released = _now()
    end = _spin(duration_ns)
    program = tl.program_id(0)
    tl.store(stamps_ptr + 1 + 2 * program, released)  # stamps[1 + 2p], stamps[2 + 2p]
    tl.store(stamps_ptr + 2 + 2 * program, end)


@triton.jit
def _last_kernel(stamps_ptr, programs, USE_PDL: tl.constexpr):
    pdl_release(USE_PDL)
    entry = _now()
    pdl_wait(USE_PDL)
    tl.store(stamps_ptr + 1 + 2 * programs, entry)  # stamps[1 + 2N]: the entry


def launch_chain(stamps: torch.Tensor, programs: int, release_before_wait: bool, warps: int,
                 first_ns: int, middle_ns: int) -> None:
    """The three kernels, PDL-launched, writing ``stamps [2 + 2 * programs]`` (int64, ns)."""
    pdl = dict(USE_PDL=True, launch_pdl=True)
    _first_kernel[(1,)](stamps, first_ns, **pdl)
    _middle_kernel[(programs,)](stamps, middle_ns, RELEASE_BEFORE_WAIT=release_before_wait,
                                num_warps=warps, **pdl)
    _last_kernel[(1,)](stamps, programs, **pdl)


def unpack(stamps: list[int], programs: int) -> tuple[int, list[int], list[int], int]:
    """One replay's stamps -> ``(first's end, middle's releases, middle's ends, last's
    entry)``, ns."""
    return (stamps[0], stamps[1:1 + 2 * programs:2], stamps[2:2 + 2 * programs:2],
            stamps[1 + 2 * programs])


def timings(stamps: list[int], programs: int) -> dict:
    """One replay's stamps -> its intervals, us."""
    first_end, releases, ends, last_entry = unpack(stamps, programs)
    return {"entry_after_release_us": (last_entry - max(releases)) / 1e3,
            "entry_after_first_kernel_us": (last_entry - first_end) / 1e3,
            "entry_after_first_end_us": (last_entry - min(ends)) / 1e3,
            "release_spread_us": (max(releases) - min(releases)) / 1e3}


def profiled(graph: torch.cuda.CUDAGraph, stamps: torch.Tensor, programs: int) -> dict:
    """One replay of ``graph`` under the profiler: ``last`` 's start after ``middle`` 's end as
    the profiler saw them, and as the stamps say (its entry after the last program's end), us."""
    from torch.profiler import ProfilerActivity, profile

    from profile_step import kernel_intervals

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        graph.replay()
        torch.cuda.synchronize()
    spans = {name: (start, end) for start, end, name in kernel_intervals(trace)}
    return profiled_intervals(spans, stamps.tolist(), programs)


def profiled_intervals(spans: dict[str, tuple[float, float]], stamps: list[int],
                       programs: int) -> dict:
    """``profiled``'s two intervals from the profiler's kernel spans (name -> (start, end),
    us) and the replay's stamps (ns), us."""
    _, _, ends, last_entry = unpack(stamps, programs)
    return {"profiler_start_after_middle_end_us":
            round(spans["_last_kernel"][0] - spans["_middle_kernel"][1], 2),
            "stamps_entry_after_middle_end_us": round((last_entry - max(ends)) / 1e3, 2)}


def measure(programs: int, release_before_wait: bool, warps: int, first_us: float,
            middle_us: float, replays: int, profile: bool) -> dict:
    """Medians over ``replays`` replays of the chain captured in a CUDA graph; with
    ``profile``, then ``profiled``'s replay."""
    stamps = torch.zeros(2 + 2 * programs, dtype=torch.int64, device="cuda")
    args = (stamps, programs, release_before_wait, warps, int(first_us * 1e3),
            int(middle_us * 1e3))
    launch_chain(*args)  # compiles outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launch_chain(*args)
    runs = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        runs.append(timings(stamps.tolist(), programs))
    medians = {key: round(statistics.median(run[key] for run in runs), 2) for key in runs[0]}
    return {**medians, **(profiled(graph, stamps, programs) if profile else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[132, 264, 1056, 4608])
    parser.add_argument("--release", nargs="+", choices=["after", "before"],
                        default=["after", "before"], help="middle releases after or before "
                        "its wait")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--first-us", type=float, default=5.0)
    parser.add_argument("--middle-us", type=float, default=15.0)
    parser.add_argument("--replays", type=int, default=11)
    parser.add_argument("--profile", action="store_true",
                        help="one more replay under torch.profiler (module docstring)")
    args = parser.parse_args()
    if not pdl_available(torch.device("cuda")):
        raise SystemExit("programmatic dependent launch needs a CUDA GPU of compute "
                         "capability 9.0 or later, with Triton compiling (not interpreting)")
    for programs in args.programs:
        for release in args.release:
            case = {"programs": programs, "release": release, "warps": args.warps,
                    "device": torch.cuda.get_device_name()}
            case.update(measure(programs, release == "before", args.warps, args.first_us,
                                args.middle_us, args.replays, args.profile))
            print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main()
