"""GPT-OSS against HF transformers on tiny random checkpoints (bf16/fp32 and MXFP4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig

from atom.loader import CheckpointError
from atom.testing import tiny_config
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


def quantize_mxfp4(linear: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> blocks [..., K/32, 16] uint8 and scales [..., K/32] uint8 (OCP MX: the
    shared exponent puts each group's largest value at or below e2m1's 6.0)."""
    codes_by_value = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = linear.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs().unsqueeze(-1) - codes_by_value).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def write_mxfp4_pair(config, folder: Path) -> tuple[Path, Path]:
    """The same model twice: with MXFP4 experts (as released GPT-OSS checkpoints store
    them), and unquantized with those experts as HF's own MXFP4 dequantization gives them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = write_with_random_vectors(config, folder / "source")
    tensors = load_file(source / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # the Linear layout
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    for kind, tensors in (("mxfp4", quantized), ("reference", dequantized)):
        out = folder / kind
        out.mkdir()
        (out / "config.json").write_text((source / "config.json").read_text())
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config_path = folder / "mxfp4" / "config.json"
    config_path.write_text(
        config_path.read_text().replace(
            '"model_type"',
            '"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": '
            '["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", '
            '"lm_head"]},\n  "model_type"',
            1,
        )
    )
    return folder / "mxfp4", folder / "reference"


def test_mxfp4_experts_load_as_hf_dequantizes_them(tmp_path, caplog):
    # MXFP4 groups 32 values along each input dim: the expert MLP must be a multiple.
    mxfp4, reference = write_mxfp4_pair(gpt_oss_config(intermediate_size=64), tmp_path)
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
