"""GLM-4.x MoE against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import Glm4MoeConfig

from atom.testing import tiny_config, tiny_fields
from tests.models.harness import (
    check_against_hf,
    check_greedy_generation,
    check_mtp_layer_skipped,
    write_checkpoint,
    write_with_random_vectors,
)

# Smaller than atom.testing's defaults (ATOM's paged path has no head_dim floor); the
# expert MLP stays no multiple of 64 or 32.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=48)


def glm_config(**overrides) -> Glm4MoeConfig:
    return tiny_config("Glm4MoeForCausalLM", **{**SMALL, **overrides})


CASES = {
    # GLM-4.5 / 4.6 / 4.7: QK-norm, q/k/v biases, half-rotary, grouped routing.
    "glm-4.5-dense1": glm_config(),
    # GLM-4.5-Air: no QK-norm; here also one group, no renormalisation, two shared experts.
    "air-one-group-no-norm": glm_config(
        use_qk_norm=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        n_shared_experts=2,
        num_experts_per_tok=3,
    ),
    "all-moe-mqa-no-bias-full-rotary": glm_config(
        first_k_dense_replace=0,
        num_hidden_layers=3,
        num_key_value_heads=1,
        attention_bias=False,
        partial_rotary_factor=1.0,
        n_group=2,
        topk_group=1,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


def test_cached_prefix_and_sharded_checkpoint(tmp_path):
    folder = write_checkpoint(
        CASES["glm-4.5-dense1"], tmp_path, init_std=0.1, max_shard_size="50KB"
    )
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_against_hf(folder, prompt_lengths=[23, 5], decode_steps=2, cached_prefix=12)


def test_mtp_layers_in_checkpoint_are_skipped_with_one_log_line(tmp_path, caplog):
    # GLM-4.5 checkpoints carry num_nextn_predict_layers MTP layers after the last layer.
    config = CASES["glm-4.5-dense1"]
    check_mtp_layer_skipped(write_with_random_vectors(config, tmp_path), config, caplog)


def test_bf16_logits_close_to_hf(tmp_path):
    # Every token takes all experts: with top-k < n, bf16 noise flips near-tied routing
    # choices now and then, a discrete jump rather than a rounding error (the fp32 tests
    # cover the routing choices). Bound: a few bf16 ULPs of the logits' scale.
    experts = tiny_fields("Glm4MoeForCausalLM")["n_routed_experts"]
    config = glm_config(n_group=1, topk_group=1, num_experts_per_tok=experts)
    folder = write_with_random_vectors(config, tmp_path, dtype=torch.bfloat16)
    check_against_hf(folder, [5, 17], decode_steps=3, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("name", ["glm-4.5-dense1", "air-one-group-no-norm"])
def test_greedy_generation_matches_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)
