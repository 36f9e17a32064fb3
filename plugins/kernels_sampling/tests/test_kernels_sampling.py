"""The qllm-kernels-sampling plugin against the ``sample_tokens`` op's contract
(``qllm.ops.sampling``): greedy rows equal ``torch.argmax`` (ties to the first column), draws
follow ``softmax(logits / T)`` (a chi-square test), ``-inf`` logits are never drawn, a seed fixes
the tokens whatever the columns' split over programs, and other seeds draw other tokens.

- CUDA (skipped without a GPU): those checks at Qwen3's 151,936 logits per row in bf16, and the
  engine's sampled steps on the kernel.
- CPU: the plugin's registration, the launcher's input checks, both kernels compiled for sm_90
  as launched on CUDA (approximate log; no spills); under the Triton interpreter
  (``test_triton_interpreter`` reruns the ``interpreted`` tests in a subprocess with
  ``TRITON_INTERPRET=1``), the checks at small vocabularies.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("qllm_kernels_sampling")

# after the skip above, so the suite runs where the plugin is not installed
from qllm.plugins.registry import PluginRegistry  # noqa: E402
from qllm.testing.kernels import HAS_TRITON, cuda, interpreted, interpreter_driver  # noqa: E402
from qllm_kernels_sampling import plugin  # noqa: E402

# chi-square critical value for 6 degrees of freedom at p = 1e-4: a correct sampler fails
# one run in 10,000
CHI_SQUARE_6_DOF = 27.86
PROBE_LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -math.inf, 0.3, 1.5]  # 7 drawable tokens


def launch():
    from qllm_kernels_sampling.triton_sample import sample_tokens

    return sample_tokens


def check_greedy_rows(device: str, vocab: int, dtype: torch.dtype) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 3] = logits[0, vocab - 2] = logits[0].float().max() + 1  # a tie: column 3 wins
    logits = logits.to(device)
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.7, 0.0], device=device)
    tokens = launch()(logits, temperature, seed=11)
    greedy = temperature == 0
    assert tokens.dtype == torch.int64 and tokens[0] == 3
    assert torch.equal(tokens[greedy], logits.float().argmax(dim=-1)[greedy])


def check_distribution(device: str, rows: int, temperature: float) -> None:
    """``rows`` draws from one row of ``PROBE_LOGITS`` against its softmax at ``temperature``."""
    logits = torch.tensor(PROBE_LOGITS, device=device).repeat(rows, 1)
    tokens = launch()(logits, torch.full((rows,), temperature, device=device), seed=5)
    counts = torch.bincount(tokens.cpu(), minlength=len(PROBE_LOGITS)).double()
    expected = rows * (torch.tensor(PROBE_LOGITS, dtype=torch.float64) / temperature).softmax(0)
    drawable = expected > 0
    assert counts[~drawable].sum() == 0  # -inf is never drawn
    chi_square = ((counts - expected)[drawable] ** 2 / expected[drawable]).sum().item()
    assert chi_square < CHI_SQUARE_6_DOF, (counts.tolist(), expected.tolist())


def check_seeds(device: str, vocab: int, monkeypatch) -> None:
    """The same seed gives the same tokens whatever the columns' split; another seed, others."""
    from qllm_kernels_sampling import triton_sample

    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    temperature = torch.full((64,), 1.5, device=device)
    tokens = launch()(logits, temperature, seed=2 ** 40 + 3)
    assert torch.equal(launch()(logits, temperature, seed=2 ** 40 + 3), tokens)
    assert (launch()(logits, temperature, seed=4) != tokens).sum() > 32
    monkeypatch.setattr(triton_sample, "STEPS_PER_PROGRAM", 1)
    assert torch.equal(launch()(logits, temperature, seed=2 ** 40 + 3), tokens)


def test_plugin_registers_sample_tokens_on_cuda_only():
    registry = PluginRegistry(extra_plugins=[plugin], load_entry_points=False)
    cpu = registry.kernels(torch.device("cpu"), torch.float32)
    assert cpu.names()["sample_tokens"] == "torch"
    (spec,) = plugin.qllm_kernels()
    assert spec.op == "sample_tokens" and spec.priority > 0
    assert spec.is_available(torch.device("cuda"), torch.bfloat16) == HAS_TRITON
    assert not spec.is_available(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("logits, temperature, message", [
    (torch.zeros(4), torch.ones(4), "logits \\[N, V\\]"),
    (torch.zeros(4, 6)[:, ::2], torch.ones(4), "unit column stride"),
    (torch.zeros(4, 6), torch.ones(3), "temperature \\[4\\] fp32"),
    (torch.zeros(4, 6), torch.ones(4, dtype=torch.float64), "temperature \\[4\\] fp32"),
], ids=["1-d", "strided", "rows", "fp64"])
def test_launcher_names_bad_inputs(logits, temperature, message):
    with pytest.raises(ValueError, match=message):
        launch()(logits, temperature, seed=0)


test_triton_interpreter = interpreter_driver(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [40, 3000], ids=lambda v: f"v{v}")
def test_interpreted_greedy_rows(vocab, dtype):
    check_greedy_rows("cpu", vocab, dtype)


@interpreted
def test_interpreted_draws_follow_the_softmax():
    check_distribution("cpu", rows=1000, temperature=0.7)


@interpreted
def test_interpreted_seeds(monkeypatch):
    check_seeds("cpu", 3000, monkeypatch)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_rows(dtype):
    check_greedy_rows("cuda", 151_936, dtype)


@cuda
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_draws_follow_the_softmax(temperature):
    check_distribution("cuda", rows=200_000, temperature=temperature)


@cuda
def test_seeds(monkeypatch):
    check_seeds("cuda", 151_936, monkeypatch)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_compile_for_sm90_as_launched_on_cuda():
    """Both kernels as the launcher calls them at W1's shape, with CUDA's approximate log,
    compile for Hopper here (no GPU needed), spilling nothing."""
    from qllm.testing.sm90 import (captured_launches, compile_for_sm90, on_meta,
                                   resource_usage, sm90_compiler_missing)

    if sm90_compiler_missing():
        pytest.skip(sm90_compiler_missing())
    logits, temperature = on_meta(torch.empty(256, 151_936, dtype=torch.bfloat16),
                                  torch.empty(256))
    launches = captured_launches(lambda: launch()(logits, temperature, seed=3))
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == ["_chunk_maximum_kernel",
                                                                 "_row_maximum_kernel"]
    for kernel, args, options in launches:
        if "FAST_LOG" in args:
            args = {**args, "FAST_LOG": True}  # the launcher's value on CUDA tensors
        usage = resource_usage(compile_for_sm90(kernel, args, options))
        assert usage["spill_bytes"] == 0, usage
