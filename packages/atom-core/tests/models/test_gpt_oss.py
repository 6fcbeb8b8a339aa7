"""GPT-OSS against HF transformers on tiny random checkpoints (bf16/fp32 and MXFP4)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig

from atom.loader import CheckpointError
from atom.testing import tiny_config
from atom.testing.mxfp4 import write_mxfp4_pair
from tests.models.harness import (
    PagedModel,
    check_against_hf,
    check_greedy_generation,
    write_checkpoint,
    write_with_random_vectors,
)

# Smaller than atom.testing's defaults (ATOM's paged path has no head_dim floor).
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=48)
# transformers < 5.24 hardcodes the SwiGLU clamp at 7.0.
HF_READS_SWIGLU_LIMIT = "swiglu_limit" in GptOssConfig().to_dict()


def gpt_oss_config(**overrides) -> GptOssConfig:
    return tiny_config("GptOssForCausalLM", **{**SMALL, **overrides})


CASES = {
    # Window 16, sliding and full layers alternating; prompts below go past the window.
    "sliding-full": gpt_oss_config(),
    "full-only-mqa-top1": gpt_oss_config(
        layer_types=["full_attention"] * 2, num_key_value_heads=1, num_experts_per_tok=1
    ),
    "three-layers-window-5": gpt_oss_config(num_hidden_layers=3, sliding_window=5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_with_random_vectors(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


@pytest.mark.skipif(not HF_READS_SWIGLU_LIMIT, reason="this transformers fixes the limit")
def test_clamped_swiglu_limit_from_config(tmp_path):
    folder = write_with_random_vectors(gpt_oss_config(swiglu_limit=0.3), tmp_path)
    check_against_hf(folder, prompt_lengths=[9, 20], decode_steps=2)


def test_cached_prefix_and_sharded_checkpoint(tmp_path):
    folder = write_checkpoint(CASES["sliding-full"], tmp_path, init_std=0.1, max_shard_size="50KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    check_against_hf(folder, prompt_lengths=[29, 5], decode_steps=3, cached_prefix=20)


def test_bf16_logits_close_to_hf(tmp_path):
    # Every token takes all experts, so bf16 noise cannot flip a routing choice.
    config = gpt_oss_config(num_experts_per_tok=8)
    folder = write_with_random_vectors(config, tmp_path, dtype=torch.bfloat16)
    check_against_hf(folder, [5, 21], decode_steps=3, dtype=torch.bfloat16, atol=5e-2)


def test_greedy_generation_matches_hf(tmp_path):
    folder = write_with_random_vectors(CASES["sliding-full"], tmp_path)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)


def test_mxfp4_experts_load_as_hf_dequantizes_them(tmp_path, caplog):
    # MXFP4 groups 32 values along each input dim: the expert MLP must be a multiple.
    source = write_with_random_vectors(gpt_oss_config(intermediate_size=64), tmp_path / "src")
    mxfp4, reference = write_mxfp4_pair(source, tmp_path)
    check_against_hf(reference, prompt_lengths=[4, 18], decode_steps=2, atom_folder=mxfp4)
    assert "MXFP4 experts are dequantized to the model dtype at load" in caplog.text


def test_missing_sinks_name_the_tensor(tmp_path):
    folder = write_with_random_vectors(CASES["sliding-full"], tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.sinks"):
        check_against_hf(folder, prompt_lengths=[3], decode_steps=0)


def test_unknown_rope_scaling_is_named(tmp_path):
    folder = write_with_random_vectors(CASES["sliding-full"], tmp_path)
    config_path = folder / "config.json"
    config_path.write_text(config_path.read_text().replace('"yarn"', '"longrope2"'))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope2'"):
        PagedModel(folder)
