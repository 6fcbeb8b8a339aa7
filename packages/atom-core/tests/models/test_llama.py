"""Llama 2/3.x and Qwen3 against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from atom.testing import tiny_config
from tests.models.harness import check_against_hf, check_greedy_generation, write_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


# Smaller than atom.testing's defaults (ATOM's paged path has no head_dim floor).
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128)


def llama_config(**overrides) -> LlamaConfig:
    fields = {**SMALL, "head_dim": 16, "rms_norm_eps": 1e-5, **overrides}
    return tiny_config("LlamaForCausalLM", **fields)


def qwen3_config(**overrides) -> Qwen3Config:
    return tiny_config("Qwen3ForCausalLM", **{**SMALL, "tie_word_embeddings": True, **overrides})


CASES = {
    "llama-gqa2": llama_config(),
    "llama-mha-tied": llama_config(num_key_value_heads=4, tie_word_embeddings=True),
    "llama-mqa-llama3-rope": llama_config(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE),
    "llama-linear-rope-bias": llama_config(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        attention_bias=True,
    ),
    "qwen3-gqa2-tied": qwen3_config(),
    "qwen3-gqa4-untied": qwen3_config(num_attention_heads=8, tie_word_embeddings=False),
    "qwen3-sliding-window": qwen3_config(
        use_sliding_window=True, sliding_window=8, max_window_layers=0
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


@pytest.mark.parametrize("name", ["llama-gqa2", "qwen3-gqa2-tied"])
def test_cached_prefix_matches_hf(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[23, 5], decode_steps=2, cached_prefix=12)


def test_sharded_checkpoint(tmp_path):
    folder = write_checkpoint(llama_config(), tmp_path, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_against_hf(folder, prompt_lengths=[9, 3], decode_steps=2)


def test_bf16_logits_close_to_hf(tmp_path):
    # bf16 keeps 8 mantissa bits; across two layers the paged path and HF's eager path
    # round in different places, so logits agree to a few bf16 ULPs at this scale.
    folder = write_checkpoint(qwen3_config(), tmp_path, dtype=torch.bfloat16)
    check_against_hf(folder, [5, 17], decode_steps=3, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("name", ["llama-gqa2", "qwen3-gqa2-tied", "llama-mqa-llama3-rope"])
def test_greedy_generation_matches_hf(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path, init_std=0.1)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)
