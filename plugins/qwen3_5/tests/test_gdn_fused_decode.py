"""The GDN layer's opt-in fused decode step (qllm-kernels-gdn's ``gdn_decode_fused`` op,
``QLLM_GDN_DECODE=fused``) on tiny random checkpoints (fp32, CPU): the switch reaches the layer
on the CPU through the op's plain-torch reference (the composition of the three ops it
replaces), so an engine with it on generates the tokens of one with it off, eagerly and under
regional ``torch.compile``, its decode steps calling the op once per GDN layer."""

from __future__ import annotations

import functools

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, random_prompts

qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")
gdn_plugin = pytest.importorskip("qllm_kernels_gdn.plugin")
from qllm_kernels_gdn import ops as gdn_ops  # noqa: E402

ENGINE = dict(block_size=16, max_model_len=160, num_kv_blocks=64, max_num_seqs=3)
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 1)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with qwen3_5_testing.torch_threads(1):
        yield


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"{request.param}-fused-gdn"))
    qwen3_5_testing.save_checkpoint(request.param, path, seed=2)
    return path


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_decode_switch_keeps_tokens(checkpoint, compiled, monkeypatch):
    if compiled and "next" in checkpoint:  # the same layer code: one compiled model suffices
        pytest.skip("compiled: Qwen3.5 only (57 s a model on the CI machine)")
    prompts = random_prompts([3, 40, 17, 70], seed=5)
    torch._dynamo.reset()  # four compiled engines in one process would reach its recompile limit
    llm = LLM(checkpoint, **ENGINE, compile_on_cpu=compiled)
    assert "gdn_decode_fused" not in llm.engine.kernels.names()  # off by default
    expected = [out["token_ids"] for out in llm.generate(prompts, PARAMS, use_tqdm=False)]

    calls = []
    reference = gdn_ops.gdn_decode_fused_reference

    @functools.wraps(reference)
    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return reference(*args, **kwargs)

    monkeypatch.setattr(gdn_plugin, "FUSED_DECODE", True)
    monkeypatch.setattr(gdn_ops, "gdn_decode_fused_reference", counted)
    torch._dynamo.reset()
    llm = LLM(checkpoint, **ENGINE, compile_on_cpu=compiled)
    assert llm.engine.kernels.names()["gdn_decode_fused"] == "torch"
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [out["token_ids"] for out in outputs] == expected
    assert calls, "no decode step took the fused op"
    assert_cache_free(llm)
