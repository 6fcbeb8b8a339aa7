"""Qwen3-MoE and Mixtral against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

from atom.testing import tiny_config
from tests.models.harness import check_against_hf, check_greedy_generation, write_checkpoint

# Smaller than atom.testing's defaults (ATOM's paged path has no head_dim floor).
SMALL = dict(vocab_size=256, hidden_size=64)


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    fields = {**SMALL, "intermediate_size": 96, "moe_intermediate_size": 32, **overrides}
    return tiny_config("Qwen3MoeForCausalLM", **fields)


def mixtral_config(**overrides) -> MixtralConfig:
    # head_dim None: HF derives hidden_size / heads.
    fields = {**SMALL, "intermediate_size": 48, "head_dim": None, "rms_norm_eps": 1e-5, **overrides}
    return tiny_config("MixtralForCausalLM", **fields)


CASES = {
    "qwen3-moe-top2-norm": qwen3_moe_config(),
    "qwen3-moe-top4-no-norm-tied": qwen3_moe_config(
        num_experts_per_tok=4, norm_topk_prob=False, tie_word_embeddings=True
    ),
    "qwen3-moe-top1-dense-layer": qwen3_moe_config(
        num_experts_per_tok=1, mlp_only_layers=[0], num_key_value_heads=4
    ),
    "qwen3-moe-sparse-step2": qwen3_moe_config(decoder_sparse_step=2, num_hidden_layers=3),
    "mixtral-top2": mixtral_config(),
    "mixtral-top1-mqa": mixtral_config(num_experts_per_tok=1, num_key_value_heads=1),
    "mixtral-sliding-window": mixtral_config(
        sliding_window=8, num_local_experts=8, num_experts_per_tok=3
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


@pytest.mark.parametrize("name", ["qwen3-moe-top2-norm", "mixtral-top2"])
def test_cached_prefix_and_sharded_checkpoint(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path, max_shard_size="50KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_against_hf(folder, prompt_lengths=[23, 5], decode_steps=2, cached_prefix=12)


@pytest.mark.parametrize("name", ["qwen3-moe-top2-norm", "mixtral-top2"])
def test_bf16_logits_close_to_hf(tmp_path, name):
    # Same bound as the dense models: a few bf16 ULPs of the logits' scale. HF also rounds
    # the routing weights and each expert's output to bf16; ATOM sums experts in fp32.
    folder = write_checkpoint(CASES[name], tmp_path, dtype=torch.bfloat16)
    check_against_hf(folder, [5, 17], decode_steps=3, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("name", ["qwen3-moe-top2-norm", "mixtral-top2"])
def test_greedy_generation_matches_hf(tmp_path, name):
    folder = write_checkpoint(CASES[name], tmp_path, init_std=0.1)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)
