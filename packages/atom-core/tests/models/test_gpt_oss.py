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
    make_prompts,
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


def mxfp4_pair(tmp_path):
    """A tiny MXFP4 GPT-OSS checkpoint and its dequantized twin (as HF dequantizes it).
    MXFP4 groups 32 values along each input dim: the expert MLP must be a multiple."""
    source = write_with_random_vectors(gpt_oss_config(intermediate_size=64), tmp_path / "src")
    return write_mxfp4_pair(source, tmp_path)


def test_mxfp4_experts_stay_packed_and_match_hf_on_the_dequantized_twin(tmp_path):
    mxfp4, reference = mxfp4_pair(tmp_path)
    check_against_hf(reference, prompt_lengths=[4, 18], decode_steps=2, atom_folder=mxfp4)
    experts = PagedModel(mxfp4).model.model.layers[0].mlp.experts
    assert not hasattr(experts, "w13_weight")
    assert experts.w13_blocks.dtype == experts.w2_scales.dtype == torch.uint8
    assert experts.w13_blocks.shape == (8, 2 * 64, 64 // 32, 16)  # 8 experts, hidden 64


def generate(folder, prompts, device: str):
    from atom import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", device=device, skip_tokenizer_init=True,
              kv_cache_memory_bytes=64 << 20)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # the torch reference (dequantized per call) and the Triton kernel (in registers)
def test_mxfp4_engine_generates_as_the_dequantized_twin(tmp_path, device):
    mxfp4, reference = mxfp4_pair(tmp_path)
    prompts = make_prompts(SMALL["vocab_size"], [3, 17, 30], seed=5)
    atol = 1e-5 if device == "cpu" else 1e-4  # Triton: the two paths tile their sums apart
    for packed, dense in zip(
        generate(mxfp4, prompts, device), generate(reference, prompts, device)
    ):
        assert packed.token_ids == dense.token_ids
        for got, want in zip(packed.logprobs, dense.logprobs):
            assert got.keys() == want.keys()
            torch.testing.assert_close(
                torch.tensor(list(got.values())), torch.tensor(list(want.values())),
                atol=atol, rtol=0,
            )  # fmt: skip


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
