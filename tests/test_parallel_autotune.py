"""parallel_autotune: an autotuned kernel's configs compile together, under Triton's
AsyncCompileMode, before the benchmark, once per tuning key. No GPU: the kernel's launches and
compiles are recorded instead of run."""

from __future__ import annotations

import weakref

import pytest

triton = pytest.importorskip("triton")
_async_compile = pytest.importorskip("triton.runtime._async_compile")

from qllm.runner.parallel_autotune import parallel_autotune  # noqa: E402
from qllm.testing.kernels import cuda  # noqa: E402


def _autotuned(events: list):
    """An autotuned kernel of two configs whose launches (``fn.run``) and compiles
    (``fn.warmup``) append to ``events``; timings come from a stub benchmarker."""
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)

    def run(*args, grid, warmup, **kwargs):
        mode = _async_compile.active_mode.get()
        events.append(("compile" if warmup else "launch", kwargs["BLOCK"], mode is not None))

    kernel.run = run
    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    tuner = triton.autotune(configs, key=["n"],
                            do_bench=lambda call, quantiles: (call(), [1.0, 1.0, 1.0])[1])(kernel)
    tuner.cache_results = False  # an engine built earlier may have set TRITON_CACHE_AUTOTUNING
    return tuner


def test_configs_compile_under_async_mode_before_the_benchmark_once_per_key():
    events = []
    kernel = _autotuned(events)
    with parallel_autotune(workers=2):
        kernel[(1,)](None, 64)
        first = list(events)
        kernel[(1,)](None, 64)  # tuned key: launched, nothing compiled ahead
        second = events[len(first):]
        kernel[(1,)](None, 128)  # a new key
    assert first[:2] == [("compile", 16, True), ("compile", 32, True)]
    assert all(kind == "launch" and not in_mode for kind, _, in_mode in first[2:])
    assert len(first) == 2 + 2 + 1  # two compiles, two benchmark launches, the launch
    assert [kind for kind, _, _ in second] == ["launch"]
    assert [kind for kind, _, _ in events[len(first) + 1:]][:2] == ["compile", "compile"]


def test_autotuner_is_put_back_after_the_block():
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.run
    with parallel_autotune(workers=1):
        assert Autotuner.run is not original
    assert Autotuner.run is original
    events = []
    _autotuned(events)[(1,)](None, 64)
    assert [kind for kind, _, _ in events] == ["launch"] * 3


@cuda
def test_real_kernel_compiles_its_configs_ahead_and_computes_the_same():
    import torch
    import triton.language as tl

    from qllm.runner.triton_compiles import TritonCompileLog

    @triton.autotune([triton.Config({"BLOCK": block}, num_warps=warps)
                      for block in (64, 128) for warps in (1, 2)], key=["n"])
    @triton.jit
    def scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 3,
                 mask=offsets < n)

    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    log = TritonCompileLog().start()
    with parallel_autotune(workers=4):
        scale[lambda meta: (triton.cdiv(1000, meta["BLOCK"]),)](x, out, 1000)
    log.stop()
    torch.testing.assert_close(out, x * 3)
    assert log.summary()["compiled"] + log.summary()["cached"] == 4


def test_switched_off_by_the_environment(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setenv("QLLM_PARALLEL_AUTOTUNE", "0")
    original = Autotuner.run
    with parallel_autotune(workers=1):
        assert Autotuner.run is original


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv("QLLM_PARALLEL_AUTOTUNE", "false")
    with pytest.raises(ValueError, match="QLLM_PARALLEL_AUTOTUNE"):
        with parallel_autotune(workers=1):
            pass


def test_tuned_configs_lists_each_key_a_kernel_was_tuned_for():
    from qllm.runner.parallel_autotune import tuned_configs

    kernel = _autotuned([])
    kernel[(1,)](None, 64)
    kernel[(1,)](None, 128)
    entries = tuned_configs([kernel])["kernel"]
    assert [entry["key"] for entry in entries] == [[128], [64]]  # sorted as text
    assert all(entry["kwargs"]["BLOCK"] in (16, 32) and entry["num_warps"] == 4
               and entry["num_stages"] >= 1 for entry in entries)
    # by default, every autotuner alive: this one's entries among them, the scan unbroken by
    # a weak proxy whose referent is gone (isinstance() on it raises ReferenceError)
    gone = weakref.proxy(type("Gone", (), {})())  # noqa: F841 (kept alive for the scan)
    assert all(entry in tuned_configs()["kernel"] for entry in entries)


@pytest.mark.parametrize("compile_ahead", ["1", "0"])
def test_each_tuning_run_is_logged_compiled_ahead_or_not(monkeypatch, compile_ahead):
    from qllm.runner.autotune_log import AutotuneLog

    monkeypatch.setenv("QLLM_PARALLEL_AUTOTUNE", compile_ahead)
    log = AutotuneLog()
    events = []
    kernel = _autotuned(events)
    with parallel_autotune(workers=1, log=log):
        kernel[(1,)](None, 64)
        kernel[(1,)](None, 64)  # tuned: not a tuning run
        kernel[(1,)](None, 128)
    summary = log.summary()
    assert (summary["keys"], summary["kernels"]) == (2, 1) and summary["seconds"] >= 0
    assert summary["top"][0]["name"] == "kernel"
    compiled_ahead = [kind for kind, _, in_mode in events if kind == "compile" and in_mode]
    assert len(compiled_ahead) == (4 if compile_ahead == "1" else 0)
