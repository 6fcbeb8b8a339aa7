"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet hybrids) against HF transformers on
tiny random checkpoints: fp32 logits through the paged path and the state pools (a mixed
batch, a prefill continued from an earlier chunk, batched decodes), greedy tokens through
the engine, the multimodal Qwen3.5 checkpoints' text model, and bad layer lists."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from atom import LLM
from atom.config import ConfigError, ModelConfig
from atom.engine.model_runner import build_model
from atom.layers.gated_delta_net import GatedDeltaNet
from atom.testing import tiny_config
from tests.models.harness import (
    FP32_ATOL,
    check_against_hf,
    check_greedy_generation,
    write_with_random_vectors,
)

TEXT_MODELS = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
BF16_STATE_ATOL = 2e-2  # seen: 5.9e-3


def hybrid_config(architecture: str, **overrides):
    # Five layers: linear, full, linear, linear, full (a full layer between linear ones).
    layer_types = ["linear_attention", "full_attention", "linear_attention"] * 2
    fields = dict(num_hidden_layers=5, layer_types=layer_types[:5])
    return tiny_config(architecture, **{**fields, **overrides})


@pytest.mark.parametrize("architecture", TEXT_MODELS)
def test_logits_match_hf(tmp_path, architecture):
    folder = write_with_random_vectors(hybrid_config(architecture), tmp_path)
    # The first prompt's first 9 tokens run in an earlier step: its prefill continues
    # from the conv and recurrent states (and KV pages) that step left.
    check_against_hf(folder, prompt_lengths=[13, 1, 6, 21], decode_steps=4, cached_prefix=9)


def test_grouped_values_and_dense_layers(tmp_path):
    # Qwen3-Next with dense MLP layers (mlp_only_layers, decoder_sparse_step) and three
    # value heads per key head.
    config = hybrid_config(
        "Qwen3NextForCausalLM",
        mlp_only_layers=[0],
        decoder_sparse_step=2,
        linear_num_value_heads=6,
        norm_topk_prob=False,
    )
    folder = write_with_random_vectors(config, tmp_path)
    check_against_hf(folder, prompt_lengths=[7, 18], decode_steps=3)


@pytest.mark.parametrize("architecture", TEXT_MODELS)
def test_greedy_generation_matches_hf(tmp_path, architecture):
    folder = write_with_random_vectors(hybrid_config(architecture), tmp_path)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=12)


@pytest.mark.parametrize(
    "architecture", ["Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
)
def test_multimodal_checkpoint_runs_its_text_model(tmp_path, architecture, caplog):
    folder = write_with_random_vectors(tiny_config(architecture), tmp_path)
    names = json.loads((folder / "config.json").read_text())
    assert names["architectures"] == [architecture] and "text_config" in names
    with caplog.at_level(logging.INFO, logger="atom.models.qwen3_next"):
        check_against_hf(folder, prompt_lengths=[5, 12], decode_steps=2)
    (line,) = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert "skipped the checkpoint's vision tower" in line


def write_config(folder, **changes):
    path = folder / "config.json"
    fields = json.loads(path.read_text())
    fields.update(changes)
    path.write_text(json.dumps(fields))


@pytest.mark.parametrize(
    ("layer_types", "message"),
    [
        (["linear_attention", "sliding_attention"], r"layer_types\[1\]='sliding_attention'"),
        (["linear_attention"], r"layer_types has 1 entries .* num_hidden_layers=2"),
    ],
)
def test_bad_layer_types_are_config_errors(tmp_path, layer_types, message):
    config = tiny_config("Qwen3_5ForCausalLM", num_hidden_layers=2, layer_types=None)
    config.layer_types = layer_types
    with pytest.raises(ConfigError, match=message):
        build_model_from(config, tmp_path)


@pytest.mark.parametrize(
    ("layer_types", "message"),
    [
        (["sliding_attention", "linear_attention"], r"layer_types\[0\]='sliding_attention'"),
        # transformers' own validator may see this one first: either way, a ConfigError.
        (["linear_attention"], r"layer_types"),
    ],
)
def test_bad_layer_types_in_config_json_are_config_errors(tmp_path, layer_types, message):
    folder = write_with_random_vectors(
        tiny_config("Qwen3_5ForCausalLM", num_hidden_layers=2), tmp_path
    )
    write_config(folder, layer_types=layer_types)
    with pytest.raises(ConfigError, match=message):
        build_model(ModelConfig.from_pretrained(folder), "cpu", progress=False)


def test_bad_full_attention_interval_is_a_config_error(tmp_path):
    config = tiny_config("Qwen3NextForCausalLM", num_hidden_layers=2)
    config.layer_types = None
    config.full_attention_interval = 0
    with pytest.raises(ConfigError, match="full_attention_interval=0"):
        build_model_from(config, tmp_path)


def build_model_from(hf_config, tmp_path):
    """ATOM's model of an HF config object (fields set after transformers validated them)."""
    folder = write_with_random_vectors(tiny_config(hf_config.architectures[0]), tmp_path)
    config = ModelConfig.from_pretrained(folder)
    config.hf_config = hf_config
    return build_model(config, "cpu", progress=False)


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_tensor_parallel_greedy_generation_matches_hf(tmp_path, architecture):
    # TP=2 over gloo: each rank holds one key head (two value heads) of every DeltaNet,
    # its slice of the conv channels and of the q|k|v projection rows.
    folder = write_with_random_vectors(hybrid_config(architecture), tmp_path)
    check_greedy_generation(
        folder, prompt_lengths=[4, 19], max_new_tokens=8, tensor_parallel_size=2
    )


# Not Qwen3.5-MoE: on its tiny checkpoint the rounding flips one token's expert choice in a
# decode step (a 1.2 logit jump), which says nothing about the state.
@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_bf16_recurrent_state_logits_match_hf(tmp_path, architecture):
    """A bf16 recurrent state (mamba_ssm_cache_dtype="bfloat16", vLLM's flag): the ops add it
    up in fp32 and store it rounded, so ATOM's logits stay within that rounding of HF's
    fp32 ones over a continued prefill and batched decodes (in fp32: 1e-4)."""
    folder = write_with_random_vectors(hybrid_config(architecture), tmp_path)
    worst = check_against_hf(
        folder, prompt_lengths=[13, 1, 6, 21], decode_steps=4, cached_prefix=9,
        ssm_dtype=torch.bfloat16, atol=BF16_STATE_ATOL,
    )  # fmt: skip
    assert worst > FP32_ATOL  # the state was stored rounded, not kept in fp32


@pytest.mark.parametrize(
    ("setting", "in_checkpoint", "want"),
    [
        ("auto", None, torch.float32),  # the model dtype
        ("bfloat16", None, torch.bfloat16),
        ("auto", "bfloat16", torch.bfloat16),  # the checkpoint's, as Qwen3.5 ships one
        ("float16", "float32", torch.float16),  # the setting over the checkpoint's
    ],
)
def test_recurrent_state_dtype_resolves_as_vllm(tmp_path, setting, in_checkpoint, want):
    folder = write_with_random_vectors(hybrid_config("Qwen3_5ForCausalLM"), tmp_path)
    if in_checkpoint:
        write_config(folder, mamba_ssm_dtype=in_checkpoint)
    llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True,
              kv_cache_memory_bytes=16 << 20, mamba_ssm_cache_dtype=setting)  # fmt: skip
    layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers and all(layer.ssm_state.dtype == want for layer in layers)
    assert all(layer.conv_state.dtype == torch.float32 for layer in layers)


def test_bad_recurrent_state_dtype_names_the_field(tmp_path):
    folder = write_with_random_vectors(hybrid_config("Qwen3NextForCausalLM"), tmp_path)
    with pytest.raises(ConfigError, match="mamba_ssm_cache_dtype='int8'"):
        LLM(str(folder), skip_tokenizer_init=True, mamba_ssm_cache_dtype="int8")
    write_config(folder, mamba_ssm_dtype="fp4")
    with pytest.raises(ConfigError, match="mamba_ssm_dtype='fp4'"):
        LLM(str(folder), skip_tokenizer_init=True)
