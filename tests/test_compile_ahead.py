"""compile_ahead: a sweep's Triton launches become compiles in a thread pool (Triton's
AsyncCompileMode, ``warmup``), nothing launched or tuned, Triton put back after. On the CPU the
launches are recorded; on CUDA a real kernel's configs compile ahead and then run correctly."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
_async_compile = pytest.importorskip("triton.runtime._async_compile")

import triton.language as tl  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from qllm.testing.benchmarking import compile_ahead  # noqa: E402
from qllm.testing.kernels import cuda  # noqa: E402


@triton.jit
def _fill(out_ptr, value, BLOCK: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, BLOCK), value)


def _recording(monkeypatch) -> list:
    """``JITFunction.run`` replaced by a recorder of (BLOCK, warmup, async mode active)."""
    events = []

    def run(self, *args, grid, warmup, **kwargs):
        events.append((kwargs["BLOCK"], warmup, _async_compile.active_mode.get() is not None))

    monkeypatch.setattr(JITFunction, "run", run)
    return events


def test_launches_become_compiles_under_async_mode_and_triton_is_put_back(monkeypatch):
    events = _recording(monkeypatch)
    recorder = JITFunction.run

    def failing():
        raise RuntimeError("a candidate that cannot even be called")

    calls = [lambda: _fill[(1,)](None, 1.0, BLOCK=16), failing,
             lambda: _fill[(1,)](None, 1.0, BLOCK=32)]
    compile_ahead(calls, workers=2)
    assert events == [(16, True, True), (32, True, True)]  # the failing call stopped nothing
    assert JITFunction.run is recorder and _async_compile.active_mode.get() is None
    _fill[(1,)](None, 1.0, BLOCK=64)
    assert events[-1] == (64, False, False)


def test_an_autotuned_kernel_compiles_its_configs_and_tunes_nothing(monkeypatch):
    events = _recording(monkeypatch)
    benchmarked = []
    tuner = triton.autotune([triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                            key=["value"],
                            do_bench=lambda call, quantiles: benchmarked.append(call))(_fill)
    tuner.cache_results = False
    original = Autotuner.run
    compile_ahead([lambda: tuner[(1,)](None, 1.0)], workers=2)
    assert sorted(events) == [(16, True, True), (32, True, True)]
    assert benchmarked == [] and tuner.cache == {}
    assert Autotuner.run is original



def test_a_tuned_or_pinned_key_compiles_its_config_alone(monkeypatch):
    """A key whose config is known (tuned, or pinned as fla's shipped configs are) compiles
    that config only, not every candidate."""
    from qllm.runner.parallel_autotune import tuning_key
    from qllm.runner.triton_precompile import compile_launches

    events = _recording(monkeypatch)
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    tuner = triton.autotune(configs, key=["value"],
                            do_bench=lambda call, quantiles: [1.0] * 3)(_fill)
    tuner.cache_results = False
    tuner.cache[tuning_key(tuner, (None, 1.0), {})] = configs[1]
    with compile_launches(workers=2):
        tuner[(1,)](None, 1.0)  # pinned: BLOCK 32 alone
        tuner[(1,)](None, 2.0)  # a key not tuned: both
    assert events[0] == (32, True, True) and sorted(events[1:]) == [(16, True, True),
                                                                   (32, True, True)]

@cuda
def test_configs_compile_ahead_then_launch_correctly():
    out = torch.zeros(64, device="cuda")
    blocks = (16, 32, 64)
    compile_ahead([lambda block=block: _fill[(1,)](out, 2.0, BLOCK=block) for block in blocks])
    assert out.eq(0).all()  # compiled, not launched
    kernel_cache = _fill.device_caches[torch.cuda.current_device()][0]
    assert len(kernel_cache) >= len(blocks)
    for block in blocks:
        out.zero_()
        _fill[(1,)](out, float(block), BLOCK=block)
        torch.testing.assert_close(out[:block], torch.full((block,), float(block), device="cuda"))
        assert out[block:].eq(0).all()
