"""FP8 MoE checkpoints (block and per-tensor experts) against a dequantized HF reference.

HF's fused expert modules cannot be hooked to quantize their inputs the way ATOM's FP8
path does, so the reference keeps activations in fp32: the bound covers e4m3 rounding of
the activations (3 mantissa bits, averaged over 128-256 long dot products).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig

from atom.engine.model_runner import StepInput
from tests.models.harness import PagedModel, load_hf, make_prompts, write_checkpoint
from tests.quantization.test_fp8_checkpoints import quantize_checkpoint


def config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_fp8_moe_checkpoint_matches_dequantized_reference(tmp_path, scheme):
    src = write_checkpoint(config(), tmp_path / "fp32", init_std=0.05)
    dst = tmp_path / "fp8"
    dst.mkdir()
    dequantized = quantize_checkpoint(src, dst, scheme)
    ref_dir = tmp_path / "dequantized"
    ref_dir.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(dequantized)
    save_file(tensors, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text((src / "config.json").read_text())

    paged = PagedModel(dst)
    experts = paged.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    prompt = make_prompts(256, [13])[0]
    atom_logits = paged.runner.run(
        [StepInput(prompt, 0, [paged.pages_for([], len(prompt))])], all_positions=True
    )
    with torch.inference_mode():
        expected = load_hf(ref_dir)(input_ids=torch.tensor([prompt])).logits[0]
    relative = (atom_logits - expected).abs().max() / expected.abs().max()
    assert relative < 0.05, f"max relative logit error {relative:.4f}"
