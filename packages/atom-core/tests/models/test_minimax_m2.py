"""MiniMax-M2 against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import MiniMaxM2Config
from transformers.models.minimax_m2 import modeling_minimax_m2

from atom.config import ConfigError
from atom.models.minimax_m2 import MiniMaxM2ForCausalLM
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
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=48)


def minimax_config(**overrides) -> MiniMaxM2Config:
    return tiny_config("MiniMaxM2ForCausalLM", **{**SMALL, **overrides})


CASES = {
    # MiniMax-M2's layout: QK-norm over all heads, rotary on half of each head, top 2 of 8.
    "m2": minimax_config(),
    "mqa-top3-full-rotary": minimax_config(
        num_hidden_layers=3,
        num_key_value_heads=1,
        num_experts_per_tok=3,
        rotary_dim=32,
        partial_rotary_factor=1.0,
    ),
    "quarter-rotary-top1": minimax_config(
        num_attention_heads=8, rotary_dim=8, partial_rotary_factor=0.25, num_experts_per_tok=1
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


def test_cached_prefix_and_sharded_checkpoint(tmp_path):
    folder = write_checkpoint(CASES["m2"], tmp_path, init_std=0.1, max_shard_size="50KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_against_hf(folder, prompt_lengths=[23, 5], decode_steps=2, cached_prefix=12)


def test_rotary_width_named_only_as_rotary_dim(tmp_path):
    # Released configs name the rotary width only as `rotary_dim`, which transformers
    # 5.12 leaves unread (its HF model then rotates whole heads): ATOM reads it there too.
    # HF runs the same weights with the width also given as partial_rotary_factor.
    folder = write_with_random_vectors(CASES["m2"], tmp_path / "hf")
    released = Path(shutil.copytree(folder, tmp_path / "released"))
    raw = json.loads((released / "config.json").read_text())
    raw.pop("partial_rotary_factor", None)
    raw.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    assert raw["rotary_dim"] == 16
    (released / "config.json").write_text(json.dumps(raw))
    check_against_hf(folder, prompt_lengths=[7, 19], decode_steps=2, atom_folder=released)


def test_without_routing_bias(tmp_path):
    # A checkpoint without the correction bias: HF routes with its zero-initialised
    # buffer, ATOM without one.
    folder = write_with_random_vectors(minimax_config(use_routing_bias=False), tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    biases = [name for name in tensors if name.endswith("e_score_correction_bias")]
    assert biases
    save_file(
        {k: v for k, v in tensors.items() if k not in biases}, path, metadata={"format": "pt"}
    )
    check_against_hf(folder, prompt_lengths=[9, 17], decode_steps=2)


def test_without_qk_norm(tmp_path, monkeypatch):
    # HF's MiniMax-M2 reads no use_qk_norm and always normalises; with the flag off the
    # reference is HF's attention without its two norms.
    original_init = modeling_minimax_m2.MiniMaxM2Attention.__init__

    def init_without_qk_norm(self, config, layer_idx):
        original_init(self, config, layer_idx)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()

    monkeypatch.setattr(modeling_minimax_m2.MiniMaxM2Attention, "__init__", init_without_qk_norm)
    folder = write_with_random_vectors(minimax_config(use_qk_norm=False), tmp_path)
    check_against_hf(folder, prompt_lengths=[9, 17], decode_steps=2)


def test_mtp_layers_in_checkpoint_are_skipped_with_one_log_line(tmp_path, caplog):
    # MiniMax-M2 checkpoints carry num_mtp_modules MTP layers after the last layer.
    config = CASES["m2"]
    check_mtp_layer_skipped(write_with_random_vectors(config, tmp_path), config, caplog)


def test_bf16_logits_close_to_hf(tmp_path):
    # Every token takes all experts: with top-k < n, bf16 noise flips near-tied routing
    # choices now and then, a discrete jump rather than a rounding error (the fp32 tests
    # cover the routing choices). Bound: a few bf16 ULPs of the logits' scale.
    experts = tiny_fields("MiniMaxM2ForCausalLM")["num_local_experts"]
    folder = write_with_random_vectors(
        minimax_config(num_experts_per_tok=experts), tmp_path, torch.bfloat16
    )
    check_against_hf(folder, [5, 17], decode_steps=3, dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("name", ["m2", "mqa-top3-full-rotary"])
def test_greedy_generation_matches_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)


@pytest.mark.parametrize(
    "field, value", [("scoring_func", "softmax"), ("qk_norm_type", "per_head")]
)
def test_unsupported_variant_names_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"MiniMax-M2 config field {field}='{value}'"):
        MiniMaxM2ForCausalLM(minimax_config(**{field: value}))
