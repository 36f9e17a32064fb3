"""Audio prompts of Qwen3-ASR: the feature extractor from transformers (the checkpoint's
``preprocessor_config.json``: 128-bin log-mel at 16 kHz, padded to whole chunks) and the
placeholder expansion of ``Qwen3ASRProcessor``.

A prompt holds ``<|audio_start|><|audio_pad|><|audio_end|>`` per clip (the chat template
writes it for an audio content part); ``<|audio_pad|>`` becomes one token per encoder output
frame (13 per second of audio, ``qllm_qwen3.asr.audio_token_count``).
"""

from __future__ import annotations

from qllm.model.multimodal import EncoderInput, InputProcessor, MediaError, MultimodalInputs, \
    content_hash, items_of, placeholder_slots

from qllm_qwen3.asr import audio_token_count

AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
ASR_TEXT = "<asr_text>"  # ends the "language <Name>" line that opens a transcript


class Qwen3ASRInputProcessor(InputProcessor):
    placeholders = {"audio": AUDIO_PLACEHOLDER}

    def __init__(self, model_dir: str, hf_config):
        self.model_dir = model_dir
        self.audio_token_id = hf_config.audio_token_id
        self.n_window = hf_config.audio_config.n_window
        self._feature_extractor = None

    @property
    def feature_extractor(self):
        if self._feature_extractor is None:
            from transformers import AutoFeatureExtractor

            try:
                self._feature_extractor = AutoFeatureExtractor.from_pretrained(self.model_dir)
            except (OSError, ValueError) as exc:
                raise MediaError(f"{self.model_dir} has no usable audio feature extractor "
                                 f"config (preprocessor_config.json): {exc}") from exc
        return self._feature_extractor

    @property
    def sampling_rate(self) -> int:
        return self.feature_extractor.sampling_rate

    def transcription_messages(self, audio, language=None, prompt=None):
        """As ``Qwen3ASRProcessor.apply_transcription_request``: the context ``prompt`` as the
        system message, the clip as the user's, and a language (a code or a name of the ones
        Qwen3-ASR was trained on) forced by starting the assistant's turn with ``language
        <Name><asr_text>``; without one the model names the language itself."""
        messages = []
        if prompt:
            messages.append({"role": "system", "content": prompt})
        messages.append({"role": "user", "content": [{"type": "audio", "audio": audio}]})
        if language is None:
            return messages, False
        from transformers.audio_utils import resolve_language
        from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

        name = resolve_language(language, LANGUAGE_CODE_TO_NAME, return_code=False)
        messages.append({"role": "assistant", "content": f"language {name}{ASR_TEXT}"})
        return messages, True

    def transcript(self, text: str) -> str:
        """The text after the ``language <Name><asr_text>`` the model writes first."""
        return text.split(ASR_TEXT, 1)[-1].strip()

    def _slots(self, token_ids: list[int], num_clips: int) -> list[int]:
        return placeholder_slots(token_ids, self.audio_token_id, num_clips, "audio",
                                 "<|audio_pad|>", "audio clip(s)")

    def positions(self, token_ids: list[int]) -> MultimodalInputs | None:
        self._slots(token_ids, 0)
        return None

    def process(self, token_ids, media):
        clips = items_of(media, "audio", "audio")
        slots = self._slots(token_ids, len(clips))
        if not clips:
            return list(token_ids), None
        expanded, items, previous = [], [], 0
        for slot, (samples, rate) in zip(slots, clips):
            if rate != self.sampling_rate:
                raise MediaError(f"audio is sampled at {rate} Hz but the model takes "
                                 f"{self.sampling_rate} Hz; resample it first")
            features = self.feature_extractor(
                samples, sampling_rate=rate, padding=True, truncation=False,
                return_attention_mask=True, n_window=self.n_window, return_tensors="pt")
            frames = int(features["attention_mask"][0].sum())
            length = audio_token_count(frames, self.n_window)
            expanded += token_ids[previous:slot]
            data = {"input_features": features["input_features"][0], "frames": frames}
            items.append(EncoderInput("audio", len(expanded), length, data,
                                      content_hash(data["input_features"])))
            expanded += [self.audio_token_id] * length
            previous = slot + 1
        expanded += token_ids[previous:]
        return expanded, MultimodalInputs(items)
