"""DeepSeek-V2 and DeepSeek-V3 (MLA, MoE) against HF transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV3Config

from atom.testing import DEEPSEEK_YARN_ROPE, tiny_config, tiny_fields
from tests.models.harness import check_against_hf, check_greedy_generation, write_checkpoint

# Weights of std 0.1 make routing and attention decisive, so a wrong detail shows in logits.
INIT_STD = 0.1

# Smaller than atom.testing's defaults (ATOM's paged path has no head_dim floor).
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=0,
)

# HF 5.12's DeepseekV2Attention leaves the softmax scale without yarn's mscale_all_dim
# factor (DeepSeek's own code and vLLM apply it; ATOM does too), so V2 is compared with
# yarn that has no mscale_all_dim; V3 covers the mscale path.
V2_YARN = {k: v for k, v in DEEPSEEK_YARN_ROPE.items() if not k.startswith("mscale")}
V3_YARN = DEEPSEEK_YARN_ROPE


def v2_config(**overrides) -> DeepseekV2Config:
    return tiny_config("DeepseekV2ForCausalLM", **{**SMALL, **overrides})


def v3_config(**overrides) -> DeepseekV3Config:
    return tiny_config("DeepseekV3ForCausalLM", **{**SMALL, **overrides})


CASES = {
    "v2-greedy-no-qlora": v2_config(routed_scaling_factor=1.5),
    "v2-group-limited-qlora-dense1": v2_config(
        q_lora_rank=24,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=1.5,
    ),
    "v2-yarn": v2_config(q_lora_rank=24, rope_parameters=V2_YARN),
    "v3-grouped-qlora-dense1": v3_config(
        q_lora_rank=24, first_k_dense_replace=1, num_hidden_layers=3
    ),
    "v3-yarn-no-qlora": v3_config(rope_parameters=V3_YARN, norm_topk_prob=False),
    "v3-neox-rope-one-group": v3_config(rope_interleave=False, n_group=1, topk_group=1),
}


pytestmark = pytest.mark.usefixtures("hf_v2_group_limited_greedy")


def randomize_correction_bias(folder: Path) -> None:
    """HF starts e_score_correction_bias at zero; a random one makes the test see it."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(3)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensor.shape, generator=gen).to(tensor.dtype) * 0.3
    save_file(tensors, path, metadata={"format": "pt"})


def write_deepseek(config, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    write_checkpoint(config, folder, dtype=dtype, init_std=INIT_STD)
    randomize_correction_bias(folder)
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(tmp_path, name):
    folder = write_deepseek(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[1, 7, 19, 33], decode_steps=4)


@pytest.mark.parametrize("name", ["v2-group-limited-qlora-dense1", "v3-grouped-qlora-dense1"])
def test_cached_prefix_matches_hf(tmp_path, name):
    folder = write_deepseek(CASES[name], tmp_path)
    check_against_hf(folder, prompt_lengths=[23, 5], decode_steps=2, cached_prefix=12)


def test_mtp_layers_in_checkpoint_are_skipped(tmp_path):
    # DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last one.
    folder = write_deepseek(CASES["v3-grouped-qlora-dense1"], tmp_path)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    mtp = {
        name.replace("model.layers.2.", "model.layers.3."): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith("model.layers.2.")
    }
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    check_against_hf(folder, prompt_lengths=[6], decode_steps=1)


def test_bf16_logits_close_to_hf(tmp_path):
    # bf16 keeps 8 mantissa bits. ATOM's decode attends in the absorbed latent space
    # (q_nope through W_UK, output through W_UV), HF in the expanded per-head space, so the
    # two round at different points; across three layers logits of magnitude ~3 agree to a
    # few bf16 ULPs (0.016 each there). Every token takes all experts here: with top-k < n,
    # bf16 noise flips near-tied routing choices now and then, which is a discrete jump
    # rather than a rounding error (the fp32 tests cover the routing choices).
    config = v3_config(
        q_lora_rank=24,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=tiny_fields("DeepseekV3ForCausalLM")["n_routed_experts"],
    )
    folder = write_deepseek(config, tmp_path, dtype=torch.bfloat16)
    check_against_hf(folder, [5, 17], decode_steps=3, dtype=torch.bfloat16, atol=8e-2)


@pytest.mark.parametrize("name", ["v2-group-limited-qlora-dense1", "v3-grouped-qlora-dense1"])
def test_greedy_generation_matches_hf(tmp_path, name):
    folder = write_deepseek(CASES[name], tmp_path)
    check_greedy_generation(folder, prompt_lengths=[3, 11, 26], max_new_tokens=16)
