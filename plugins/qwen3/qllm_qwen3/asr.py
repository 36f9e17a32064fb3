"""Qwen3-ASR (transformers' ``Qwen3ASRForConditionalGeneration``): a Whisper-style audio
encoder over 128-bin log-mel features at 16 kHz, a projector to the text hidden size, and a
dense Qwen3 decoder (``qllm_qwen3.model``) whose ``<|audio_pad|>`` tokens take the projected
audio frames.

The encoder (``model.audio_tower.*``): the mel frames cut into chunks of ``2 * n_window``
frames, each through three stride-2 3x3 convolutions (GELU) and ``conv_out`` to ``d_model``,
plus sinusoidal positions restarting in each chunk; the valid frames of all chunks, in
order, through pre-norm transformer layers whose attention stays within windows of
``n_window_infer / (2 * n_window)`` chunks' worth of frames; ``ln_post``. The projector
(``model.multi_modal_projector.*``): ``linear_1`` -> GELU -> ``linear_2``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qllm.config import EngineConfig
from qllm.plugins.registry import Kernels

from qllm_qwen3.model import Qwen3ForCausalLM

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
               "silu": F.silu}


def post_cnn_length(frames: int) -> int:
    """Frames left of ``frames`` after three (kernel 3, stride 2, padding 1) convolutions."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


def audio_token_count(frames: int, n_window: int) -> int:
    """Encoder outputs (placeholder tokens) of a clip of ``frames`` valid mel frames."""
    chunk = 2 * n_window
    return (frames // chunk) * post_cnn_length(chunk) + post_cnn_length(frames % chunk)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=True)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        """``x [N, dim]`` -> ``[N, dim]``, bidirectional within each window."""
        heads = (self.num_heads, self.head_dim)
        q, k, v = (proj(x).unflatten(-1, heads).transpose(0, 1)  # [h, N, d]
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = [F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
               zip(q.split(windows, 1), k.split(windows, 1), v.split(windows, 1))]
        return self.out_proj(torch.cat(out, dim=1).transpose(0, 1).flatten(1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = AudioAttention(config.d_model, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """``Qwen3ASREncoder`` over one clip: ``features [mels, L]`` as the feature extractor pads
    them (to whole chunks), of which the first ``frames`` are valid ->
    ``[audio_token_count(frames), d_model]``."""

    def __init__(self, config):
        super().__init__()
        self.n_window, self.n_window_infer = config.n_window, config.n_window_infer
        self.d_model = config.d_model
        self.max_positions = config.max_position_embeddings
        hidden = config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        bins = config.num_mel_bins
        for _ in range(3):
            bins = (bins + 1) // 2
        self.conv_out = nn.Linear(hidden * bins, config.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(config)
                                    for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.register_buffer("positional_embedding",
                             torch.empty(self.max_positions, config.d_model), persistent=False)

    def reset_derived_buffers(self) -> None:
        """Whisper's sinusoids: ``[sin | cos]`` of ``position * 10000 ** (-i / (d/2 - 1))``."""
        half = self.d_model // 2
        increment = math.log(10000) / (half - 1)
        device = self.positional_embedding.device
        inv = torch.exp(-increment * torch.arange(half, device=device).float())
        angles = torch.arange(self.max_positions, device=device)[:, None] * inv[None, :]
        self.positional_embedding.copy_(torch.cat([angles.sin(), angles.cos()], dim=1))

    def forward(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        mels, length = features.shape
        chunk = 2 * self.n_window
        num_chunks = -(-frames // chunk)
        padded = F.pad(features, (0, max(0, num_chunks * chunk - length)))[:, :num_chunks * chunk]
        chunks = padded.view(mels, num_chunks, chunk).transpose(0, 1)[:, None]  # [C, 1, M, L]
        x = F.gelu(self.conv2d1(chunks.to(self.conv2d1.weight.dtype)))
        x = F.gelu(self.conv2d2(x))
        x = F.gelu(self.conv2d3(x))  # [C, ch, f, t]
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))  # [C, t, d]
        x = x + self.positional_embedding[:x.shape[1]].to(x.dtype)
        chunk_frames = [min(chunk, frames - i * chunk) for i in range(num_chunks)]
        lengths = [post_cnn_length(n) for n in chunk_frames]
        x = torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # [N, d], valid frames
        # attention windows: n_window_infer frames' worth of the longest chunk's outputs
        window = max(lengths) * (self.n_window_infer // chunk)
        total = x.shape[0]
        windows = [window] * (total // window) + ([total % window] if total % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        return self.ln_post(x)


class Projector(nn.Module):
    def __init__(self, config):
        super().__init__()
        audio = config.audio_config
        self.linear_1 = nn.Linear(audio.d_model, audio.d_model)
        self.linear_2 = nn.Linear(audio.d_model, audio.output_dim)
        self.act = ACTIVATIONS[audio.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Qwen3ASRForConditionalGeneration(Qwen3ForCausalLM):
    """The Qwen3 decoder of ``text_config`` plus ``audio_tower`` and
    ``multi_modal_projector``; audio prompts through ``qllm_qwen3.asr_processing``."""

    def __init__(self, hf_config, kernels: Kernels, engine_config: EngineConfig):
        self.hf_config = hf_config
        super().__init__(hf_config.get_text_config(), kernels, engine_config)
        self.audio_tower = AudioEncoder(hf_config.audio_config)
        self.multi_modal_projector = Projector(hf_config)

    def tie_weights(self) -> None:
        # transformers ties on the config the top-level model was built from
        if self.hf_config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_name(self, name: str) -> str | tuple[str, None] | None:
        if name == "lm_head.weight" and self.hf_config.tie_word_embeddings:
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        for prefix in ("audio_tower.", "multi_modal_projector."):
            if name.startswith("model." + prefix):  # its own q/k/v: not the packed qkv_proj
                return name[len("model."):], None
        return name

    def input_processor(self, model_dir: str, tokenizer):
        from qllm_qwen3.asr_processing import Qwen3ASRInputProcessor

        return Qwen3ASRInputProcessor(model_dir, self.hf_config)

    def encode(self, item) -> torch.Tensor:
        """One clip's projected frames ``[item.length, H]`` from its ``input_features``."""
        device = self.audio_tower.conv2d1.weight.device
        features = item.data["input_features"].to(device)  # [mels, L], padded to whole chunks
        return self.multi_modal_projector(self.audio_tower(features, item.data["frames"]))
