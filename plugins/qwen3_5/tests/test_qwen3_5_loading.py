"""Loading every Qwen3.5 / Qwen3-Next checkpoint layout, and clear errors for bad ones."""

from __future__ import annotations

import logging
import shutil
import types

import pytest
import torch

from qllm import LLM
from qllm.model.loader import CheckpointError
from qllm.testing import assert_cache_free, prefill_logits, random_prompts

qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")

ENGINE = dict(block_size=16, max_model_len=256, num_kv_blocks=32)
PROMPT = random_prompts([100], seed=5)[0]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{kind: (dir, transformers model)}`` for every kind the tests here load."""
    made = {}
    for kind in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next"):
        path = str(tmp_path_factory.mktemp(kind))
        made[kind] = path, qwen3_5_testing.save_checkpoint(kind, path, seed=2)
    return made


def copy_of(checkpoints, kind: str, tmp_path) -> str:
    path = str(tmp_path / kind)
    shutil.copytree(checkpoints[kind][0], path)
    return path


def add_unused_tensors(tensors: dict) -> dict:
    """What official checkpoints carry beside the text model: the MTP head (and the vision
    tower, which the multimodal fixtures already have)."""
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    return tensors


# ----------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("kind,fused_experts", [
    pytest.param("qwen3_5_vl", False, id="dense-multimodal"),
    pytest.param("qwen3_5_moe", True, id="moe-fused-experts"),
    pytest.param("qwen3_5_moe_vl", True, id="moe-multimodal-fused-experts"),
    pytest.param("qwen3_next", True, id="next-fused-experts"),
])
def test_layouts_load_and_match_transformers(checkpoints, tmp_path, caplog, kind,
                                              fused_experts):
    path = copy_of(checkpoints, kind, tmp_path)
    qwen3_5_testing.rewrite_checkpoint(path, lambda t: add_unused_tensors(
        qwen3_5_testing.fuse_experts(t) if fused_experts else t))
    caplog.set_level(logging.INFO, logger="qllm.model.loader")
    llm = LLM(path, **ENGINE)
    expected = qwen3_5_testing.hf_logits(checkpoints[kind][1], PROMPT)[-1]
    torch.testing.assert_close(prefill_logits(llm, PROMPT)[-1], expected, atol=1e-4, rtol=0)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1, skipped  # mtp.* and model.visual.*: one line, not one per tensor
    assert_cache_free(llm)


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "not-asked"])
def test_prefix_caching_without_state_checkpoints_is_off_with_one_log_line(checkpoints, caplog,
                                                                            asked):
    caplog.set_level(logging.INFO)
    llm = LLM(checkpoints["qwen3_5"][0], **ENGINE, enable_prefix_caching=asked,
              prefix_state_cache_slots=0)
    lines = [r for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == (1 if asked else 0)
    assert not llm.engine.cache.prefix_caching


def test_cache_kinds_follow_layer_types(checkpoints):
    llm = LLM(checkpoints["qwen3_next"][0], **ENGINE, max_num_seqs=5)
    pools = llm.engine.cache.pools
    assert len(pools["recurrent_slot"].layers) == 3 and len(pools["paged_kv"].layers) == 1
    gdn = pools["recurrent_slot"].layers[0]
    rows = 5 + 1 + pools["recurrent_slot"].checkpoints.num_rows  # slots, padding, checkpoints
    assert gdn.conv_state.shape == (rows, 2 * 2 * 16 + 4 * 8, 3)  # [rows, conv_dim, K - 1]
    assert gdn.ssm_state.shape == (rows, 4, 16, 8) and gdn.ssm_state.dtype == torch.float32


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("edit,message", [
    pytest.param(lambda c: c.update(layer_types=["linear_attention", "sliding_attention",
                                                 "linear_attention", "full_attention"]),
                 r"layer_types\[1\] is 'sliding_attention'", id="unsupported-layer-type"),
    pytest.param(lambda c: c.update(layer_types=["linear_attention", "full_attention"]),
                 r"number of `layer_types` \(2\)", id="layer-types-count"),  # transformers
    pytest.param(lambda c: c.update(linear_num_value_heads=3),
                 r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)",
                 id="gdn-head-counts"),
    pytest.param(lambda c: c.update(num_key_value_heads=3),
                 r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
                 id="attention-head-counts"),
])
def test_inconsistent_config_is_a_clear_error(checkpoints, tmp_path, edit, message):
    path = copy_of(checkpoints, "qwen3_5", tmp_path)
    qwen3_5_testing.edit_config(path, edit)
    with pytest.raises(Exception, match=message):
        LLM(path, **ENGINE)


def test_layer_count_checked_without_transformers_validation():
    from qllm_qwen3_5.config import Qwen3_5ConfigError, validate, variant_of

    config = qwen3_5_testing.build_hf_model("qwen3_5").config.to_dict()
    config["layer_types"] = config["layer_types"][:3]
    with pytest.raises(Qwen3_5ConfigError, match="layer_types lists 3 layers but "
                                                 "num_hidden_layers is 4"):
        validate(types.SimpleNamespace(**config), variant_of("Qwen3_5ForCausalLM", config))


def drop(name: str):
    def edit(tensors):
        assert name in tensors, sorted(tensors)
        del tensors[name]
        return tensors
    return edit


@pytest.mark.parametrize("kind,edit,message", [
    pytest.param("qwen3_5", drop("model.layers.0.linear_attn.A_log"),
                 r"model\.layers\.0\.linear_attn\.A_log", id="missing-A_log"),
    pytest.param("qwen3_5", drop("model.layers.1.linear_attn.in_proj_b.weight"),
                 r"model\.layers\.1\.linear_attn\.in_proj\.weight \(in_proj_b shard\)",
                 id="missing-in_proj_b"),
    pytest.param("qwen3_5", drop("model.layers.2.linear_attn.conv1d.weight"),
                 r"model\.layers\.2\.linear_attn\.conv1d\.weight", id="missing-conv1d"),
    pytest.param("qwen3_next", drop("model.layers.0.linear_attn.in_proj_qkvz.weight"),
                 r"in_proj\.weight \(in_proj_qkvz shard\)", id="missing-in_proj_qkvz"),
    pytest.param("qwen3_5_moe", drop("model.layers.1.mlp.experts.2.down_proj.weight"),
                 r"model\.layers\.1\.mlp\.experts\.down_proj\.weight \(down:2 shard\)",
                 id="missing-expert"),
    pytest.param("qwen3_5_moe", drop("model.layers.1.mlp.shared_expert.up_proj.weight"),
                 r"model\.layers\.1\.mlp\.shared_expert\.gate_up_proj\.weight \(up shard\)",
                 id="missing-shared-expert-up"),
    pytest.param("qwen3_5_moe", drop("model.layers.1.mlp.shared_expert_gate.weight"),
                 r"model\.layers\.1\.mlp\.input_proj\.weight \(shared_expert_gate shard\)",
                 id="missing-shared-expert-gate"),
    pytest.param("qwen3_next", lambda t: {
        **t, "model.layers.0.linear_attn.in_proj_ba.weight": torch.zeros(6, 64)},
        r"in_proj_ba.*\(6, 64\)", id="wrong-shape-in_proj_ba"),
])
def test_bad_checkpoint_is_a_clear_error(checkpoints, tmp_path, kind, edit, message):
    path = copy_of(checkpoints, kind, tmp_path)
    qwen3_5_testing.rewrite_checkpoint(path, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(path, **ENGINE)
