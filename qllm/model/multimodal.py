"""What the core knows of multimodal prompts: encoder inputs attached to a request, the
placeholder tokens their outputs replace, and multi-axis rotary positions.

A model plugin whose model takes images or audio gives its ``CausalLM`` an
``input_processor(model_dir, tokenizer)`` (an ``InputProcessor``) and an ``encode(item)``.
The processor turns a prompt's token ids, which hold one placeholder token per media item,
and the media into the expanded token ids (``item.length`` placeholders per item) plus one
``EncoderInput`` per item; the engine attaches them to the request (``Sequence.multimodal``).
At the prefill step that first reaches an item's placeholders, the runner calls
``model.encode(item)`` once and keeps the output on the item (``item.embeds``), so a chunked
or preempted-and-recomputed prompt never reruns the encoder; each step's rows of the
placeholders take their slice of it in place of the token embeddings
(``ForwardBatch.multimodal``).

A model whose rotary positions have several axes (M-RoPE: temporal, height, width) sets
``CausalLM.rotary_position_axes``; it then gets ``positions [A, T]``. The processor gives a
prompt's positions per axis (``MultimodalInputs.positions``); every later token, and every
token of a text-only prompt, sits at ``index + position_delta`` on all axes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import wave
from dataclasses import dataclass, field
from typing import Any

import torch

MODALITIES = ("image", "audio")


class MediaError(ValueError):
    """A media item cannot be decoded or does not fit the model (a clear, user-facing
    message: the server answers it with a 400). ``param``: the request field at fault, when
    known (``messages.0.content.1.input_audio.format``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class EncoderInput:
    """One media item of a request: its encoder's inputs (``data``: host tensors, e.g.
    ``pixel_values`` and ``image_grid_thw``), where its placeholder tokens lie in the prompt
    (``offset``, ``length``; the encoder yields ``length`` rows) and, once encoded, the
    encoder's output ``embeds [length, H]`` on the device."""

    modality: str
    offset: int
    length: int
    data: dict[str, Any]
    content_hash: str = ""
    embeds: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultimodalInputs:
    """A request's encoder inputs in prompt order, and (for a multi-axis rotary model) its
    prompt's positions ``[A][P]`` with the offset of the tokens after it."""

    items: list[EncoderInput] = field(default_factory=list)
    positions: list[list[int]] | None = None
    position_delta: int = 0

    @property
    def first_placeholder(self) -> int | None:
        return min((item.offset for item in self.items), default=None)


class InputProcessor:
    """A model's prompt processing for media (implemented by its plugin).

    ``placeholders``: modality -> the text that stands for one item in a prompt (e.g.
    ``"<|vision_start|><|image_pad|><|vision_end|>"``); ``process`` expands it."""

    placeholders: dict[str, str] = {}

    def transcription_messages(self, audio: Any, language: str | None = None,
                               prompt: str | None = None) -> tuple[list[dict], bool]:
        """The chat messages that ask this model for the transcript of ``audio`` (an audio
        item, as ``load_audio`` takes), in ``language`` if given, with ``prompt`` as context
        (hot words, the previous segment), and whether the last message is an assistant
        turn for the chat template to continue (``continue_final_message``). Raises
        ``MediaError`` for a model that does not transcribe audio, ``ValueError`` for a
        language it does not know."""
        raise MediaError("this model does not transcribe audio")

    def transcript(self, text: str) -> str:
        """The transcript in a reply to ``transcription_messages``."""
        return text.strip()

    def process(self, token_ids: list[int], media: dict[str, list[Any]]
                ) -> tuple[list[int], MultimodalInputs]:
        """``token_ids`` with one placeholder per item of ``media`` (modality -> decoded
        items, in prompt order) -> the expanded token ids and the request's inputs. Raises
        ``MediaError`` when the media do not match the placeholders or cannot be used."""
        raise NotImplementedError

    def positions(self, token_ids: list[int]) -> MultimodalInputs | None:
        """The inputs of a prompt without media (None: plain positions); a processor may
        reject placeholder tokens that no media item fills."""
        return None


def items_of(media: dict[str, list[Any]], modality: str, noun: str) -> list[Any]:
    """The items of the one ``modality`` a model takes (``noun`` in messages: "images");
    ``MediaError`` naming any other modality in ``media``."""
    unknown = sorted(set(media) - {modality})
    if unknown:
        raise MediaError(f"this model takes {noun}, not {', '.join(unknown)}")
    return media.get(modality, [])


def placeholder_slots(token_ids: list[int], token_id: int, num_items: int, kind: str,
                      token: str, items: str) -> list[int]:
    """Indices of the ``token_id`` placeholders in ``token_ids``; ``MediaError`` unless there
    is one per item (messages name the ``kind`` of placeholder, its ``token`` text and the
    ``items``, e.g. "image", "<|image_pad|>", "image(s)")."""
    slots = [i for i, t in enumerate(token_ids) if t == token_id]
    if len(slots) != num_items:
        raise MediaError(f"the prompt holds {len(slots)} {kind} placeholder(s) ({token}) but "
                         f"{num_items} {items} were given")
    return slots


def rotary_positions(mm: MultimodalInputs | None, start: int, end: int,
                     axes: int) -> list[list[int]]:
    """Positions ``[axes][end - start]`` of tokens ``start .. end - 1`` of a sequence."""
    if mm is None or mm.positions is None:
        row = list(range(start, end))
        return [row] * axes
    prompt_len = len(mm.positions[0])
    out = []
    for axis in mm.positions:
        row = axis[start:min(end, prompt_len)]
        row += range(max(start, prompt_len) + mm.position_delta, end + mm.position_delta)
        out.append(row)
    return out


def encoder_rows(mm: MultimodalInputs | None, start: int, end: int
                 ) -> list[tuple[EncoderInput, int, int]]:
    """The items whose placeholders overlap tokens ``start .. end - 1``, each with the
    overlap as ``(item, first, last)`` offsets into the item's rows."""
    if mm is None:
        return []
    return [(item, max(start, item.offset) - item.offset, min(end, item.end) - item.offset)
            for item in mm.items if item.offset < end and item.end > start]


# ----------------------------------------------------------------------------- media decoding

def _decode_base64(text: str) -> bytes:
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if ";base64" not in header:
            raise MediaError("a data URL must be base64-encoded (data:<type>;base64,...)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"media data is neither a file path nor valid base64 ({exc})") from exc


def _media_bytes(source: Any, kind: str) -> bytes | None:
    """The bytes of ``source`` given as bytes, a data URL, base64 or a local path; None if it
    is none of those. Remote URLs are refused: qllm fetches nothing."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        return None
    if source.startswith(("http://", "https://")):
        raise MediaError(f"remote {kind} URLs are not fetched; send the {kind} itself "
                         f"(a base64 data URL)")
    if source.startswith("file://"):
        source = source[len("file://"):]
    if not source.startswith("data:") and os.path.isfile(source):
        with open(source, "rb") as f:
            return f.read()
    if not source.startswith("data:") and ("/" in source[:1] or len(source) < 16):
        raise MediaError(f"{kind} file {source!r} does not exist")
    return _decode_base64(source)


def load_image(source: Any):
    """A ``PIL.Image`` in RGB from a PIL image, a path, bytes, base64 or a data URL."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - pillow is a plugin extra
        raise MediaError("image inputs need Pillow (pip install pillow)") from exc
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    data = _media_bytes(source, "image")
    if data is None:
        raise MediaError(f"an image must be a PIL image, a path, bytes or base64, "
                         f"got {type(source).__name__}")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MediaError(f"cannot decode the image: {exc}") from exc
    return image.convert("RGB")


def load_audio(source: Any, sampling_rate: int | None = None):
    """``(samples float32 [N] mono, rate)`` from ``(array, rate)``, ``{"array", "sampling_rate"}``,
    or a WAV file (path, bytes, base64, data URL). With ``sampling_rate``, another rate is an
    error (qllm does not resample)."""
    import numpy as np

    if isinstance(source, dict) and "array" in source:
        source = (source["array"], source.get("sampling_rate"))
    if isinstance(source, (tuple, list)) and len(source) == 2 and not isinstance(
            source[0], (int, float)):
        samples, rate = source
        samples = np.asarray(samples.numpy() if isinstance(samples, torch.Tensor) else samples,
                             dtype=np.float32)
        if not isinstance(rate, int) or rate <= 0:
            raise MediaError(f"an audio array needs its sampling rate as a positive int, "
                             f"got {rate!r}")
    else:
        data = _media_bytes(source, "audio")
        if data is None:
            raise MediaError(f"audio must be (array, sampling_rate), a WAV path, bytes or "
                             f"base64, got {type(source).__name__}")
        samples, rate = _read_wav(data)
    if samples.ndim == 2:  # [N, channels] -> mono
        samples = samples.mean(axis=1)
    if samples.ndim != 1 or samples.size == 0:
        raise MediaError(f"audio must be a non-empty 1-D (or [N, channels]) array, got shape "
                         f"{samples.shape}")
    if not np.isfinite(samples).all():
        raise MediaError("audio samples must be finite")
    if sampling_rate is not None and rate != sampling_rate:
        raise MediaError(f"audio is sampled at {rate} Hz but the model takes {sampling_rate} Hz;"
                         f" resample it first")
    return samples, rate


def _read_wav(data: bytes):
    import numpy as np

    try:
        with wave.open(io.BytesIO(data)) as f:
            rate, width, channels = f.getframerate(), f.getsampwidth(), f.getnchannels()
            frames = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as exc:
        raise MediaError(f"cannot decode the audio (a PCM WAV file is expected): {exc}") from exc
    if width == 1:
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(frames, dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    else:
        raise MediaError(f"WAV samples of {width} bytes are not supported (8, 16 or 32-bit PCM)")
    return samples.reshape(-1, channels) if channels > 1 else samples, rate


def content_hash(*arrays) -> str:
    """A digest of an item's encoder inputs (tensors or arrays)."""
    digest = hashlib.sha256()
    for array in arrays:
        tensor = torch.as_tensor(array).contiguous()
        digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- chat content

def content_media(part: dict, where: str) -> tuple[str, Any]:
    """``(modality, item)`` of a media content part: ``{"type": "image", "image": x}``,
    ``{"type": "image_url", "image_url": {"url": x}}`` (a data URL), ``{"type": "audio",
    "audio": x}`` or OpenAI's ``{"type": "input_audio", "input_audio": {"data": base64,
    "format": "wav"}}``. Raises ``MediaError`` naming ``where`` (the part's path) for
    anything else."""
    kind = part.get("type")
    if kind in ("image", "image_url"):
        value = part.get(kind)
        if kind == "image_url" and isinstance(value, dict):
            value = value.get("url")
        modality = "image"
    elif kind in ("audio", "input_audio"):
        value = part.get(kind)
        if kind == "input_audio" and isinstance(value, dict):
            if value.get("format", "wav") != "wav":
                raise MediaError(f"{where}.input_audio.format must be 'wav', got "
                                 f"{value.get('format')!r}", f"{where}.input_audio.format")
            value = value.get("data")
        modality = "audio"
    else:
        raise MediaError(f"{where}.type must be 'text', 'image', 'image_url', 'audio' or "
                         f"'input_audio', got {kind!r}", f"{where}.type")
    if value is None:
        raise MediaError(f"{where} has no {kind} data", where)
    return modality, value


def flatten_content(conversation: list, placeholders: dict[str, str],
                    where: str = "messages[{i}].content[{j}]") -> tuple[list, dict[str, list]]:
    """A conversation whose messages' ``content`` may be a list of parts (text, images,
    audio) -> the same messages with string content, each media part replaced by its
    model's placeholder text (``placeholders``: modality -> text), and the media in order
    (modality -> items). Other messages pass through unchanged. ``where``: how errors name
    part j of message i (the server's ``messages.{i}.content.{j}``)."""
    messages, media = [], {}
    for i, message in enumerate(conversation if isinstance(conversation, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        text = []
        for j, part in enumerate(content):
            path = where.format(i=i, j=j)
            if not isinstance(part, dict):
                raise MediaError(f"{path} must be a dict with a 'type', got {part!r}", path)
            if part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise MediaError(f"{path}.text must be a string", f"{path}.text")
                text.append(part["text"])
                continue
            modality, item = content_media(part, path)
            if modality not in placeholders:
                raise MediaError(f"{path}: this model takes no {modality} inputs", path)
            text.append(placeholders[modality])
            media.setdefault(modality, []).append(item)
        messages.append({**message, "content": "".join(text)})
    return (messages if isinstance(conversation, list) else conversation), media
