"""Qwen3-ASR against transformers on a tiny random checkpoint (fp32, CPU): the audio encoder,
and the greedy transcript tokens of two synthetic clips (sine sweeps) with the prompt that
the processor's chat template forms; bad audio gets a clear error."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.model.multimodal import MediaError
from qllm.testing import assert_cache_free, require_qwen3_plugin

require_qwen3_plugin()
from qllm_qwen3.testing import RATE, save_asr_checkpoint, sweep  # noqa: E402

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, transformers model, processor)`` of the tiny Qwen3-ASR."""
    path = str(tmp_path_factory.mktemp("qwen3-asr"))
    return (path, *save_asr_checkpoint(path))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], block_size=16, max_model_len=256, num_kv_blocks=64)


CLIPS = [sweep(1.3, 200, 3000), sweep(2.7, 3500, 150)]  # 17 and 36 audio tokens


def test_audio_encoder_matches_transformers(checkpoint, llm):
    path, model, processor = checkpoint
    for clip in CLIPS:
        inputs = processor.apply_transcription_request(clip)
        with torch.no_grad():
            expected = model.model.get_audio_features(
                inputs["input_features"], inputs["input_features_mask"]).pooler_output
        _, mm = llm.engine.process_prompt(
            processor.apply_transcription_request(clip, tokenize=False)[0],
            {"audio": [(clip, RATE)]})
        with torch.no_grad():
            ours = llm.engine.model.encode(mm.items[0])
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_transcripts_match_transformers(checkpoint, llm):
    """``llm.chat`` with audio content parts, both clips in one batch: the processor's prompt
    tokens and transformers' greedy transcript tokens."""
    _, model, processor = checkpoint
    expected = []
    for clip in CLIPS:
        inputs = processor.apply_transcription_request(clip)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        expected.append((inputs["input_ids"][0].tolist(),
                         out[0, inputs["input_ids"].shape[1]:].tolist()))
    engine = llm.engine
    seqs = [engine.add_request(processor.apply_transcription_request(clip, tokenize=False)[0],
                               GREEDY, media={"audio": [(clip, RATE)]}) for clip in CLIPS]
    while engine.has_unfinished():
        engine.step()
    for seq, (prompt, tokens) in zip(seqs, expected):
        assert seq.token_ids[:seq.num_prompt_tokens] == prompt
        assert seq.output_token_ids == tokens
    assert_cache_free(llm)


def test_bad_audio_gets_clear_errors(checkpoint, llm, tmp_path):
    from PIL import Image

    engine = llm.engine
    prompt = "<|audio_start|><|audio_pad|><|audio_end|>"
    bad = [({"audio": [(CLIPS[0], 8000)]}, "sampled at 8000 Hz but the model takes 16000"),
           ({"audio": [b"RIFF not a wav file at all"]}, "cannot decode the audio"),
           ({}, "1 audio placeholder(s)"),
           ({"image": [Image.new("RGB", (32, 32))]}, "takes audio, not image")]
    for media, message in bad:
        with pytest.raises(MediaError, match=re.escape(message)):
            engine.add_request(prompt, GREEDY, media=media)
    assert not engine.has_unfinished()


def test_chat_takes_audio_parts(checkpoint, llm, tmp_path):
    """``llm.chat`` with an ``input_audio`` part (base64 WAV) and an ``audio`` part (a WAV
    path), and ``llm.generate`` with ``(array, rate)``: transformers' transcript tokens."""
    import base64
    import wave

    _, model, processor = checkpoint
    file = tmp_path / "clip.wav"
    with wave.open(str(file), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes((CLIPS[0] * 32767).astype("<i2").tobytes())
    samples = (CLIPS[0] * 32767).astype("<i2").astype(np.float32) / 32768
    inputs = processor.apply_transcription_request(samples)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    data = base64.b64encode(file.read_bytes()).decode()
    replies = llm.chat([
        [{"role": "user", "content": [{"type": "input_audio",
                                       "input_audio": {"data": data, "format": "wav"}}]}],
        [{"role": "user", "content": [{"type": "audio", "audio": str(file)}]}]],
        GREEDY, use_tqdm=False)
    assert [r["prompt_token_ids"] for r in replies] == [inputs["input_ids"][0].tolist()] * 2
    assert [r["token_ids"] for r in replies] == [expected, expected]
    prompt = processor.apply_transcription_request(samples, tokenize=False)[0]
    [result] = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": (samples, RATE)}},
                            GREEDY, use_tqdm=False)
    assert result["token_ids"] == expected
    assert os.path.exists(file)
    assert_cache_free(llm)
