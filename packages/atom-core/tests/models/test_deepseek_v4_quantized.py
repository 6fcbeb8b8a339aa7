"""DeepSeek-V4 from checkpoints quantized as the releases store them (FP8 128x128 blocks
with power-of-two scales; routed experts in FP4 or FP8), against HF transformers fp32 on
the dequantized weights (atom.testing.deepseek_v4_quant writes both).

The reference quantizes the inputs of the GEMMs ATOM runs in FP8 the way ATOM's kernels
do (e4m3, per token and group of 128), so both sides compute the same math: the logits
agree to ~1e-6 but where an activation rounds the other way (`ATOL`), while a misread
checkpoint (a scale from the wrong block or group, the nibbles of a byte swapped) is off
by more than 6 (`test_a_misread_layout_shows`).
The dims are the tiny config's, widened to hold several FP8 blocks and FP4 groups (the
q-LoRA rank ends in a partial block).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom import LLM
from atom.config import ConfigError, ModelConfig
from atom.engine.model_runner import StepInput, build_model
from atom.loader import CheckpointError
from atom.models.deepseek_v4 import released_name
from atom.testing import random_prompts, tiny_config
from atom.testing.deepseek_v4_quant import (
    FP8_LAYERS,
    release_quantization_config,
    write_release_quantized_pair,
)
from tests.models.harness import PagedModel, check_against_hf, hf_logits, load_hf, write_checkpoint
from tests.models.test_deepseek_v4 import ARCHITECTURE, GREEDY, LONG, write_v4
from tests.quantization.test_fp8_checkpoints import E4M3_MAX, fake_quant

WIDE = dict(
    hidden_size=256, moe_intermediate_size=128, q_lora_rank=192, head_dim=64,
    o_lora_rank=64, index_head_dim=64,
)  # fmt: skip
# Where an activation lands on the other side of an e4m3 rounding step (the CPU's GEMM
# sums in another order than HF's), the logits move by up to ~1e-2, and by up to ~0.2 with
# the experts in FP8 too (more such steps, and routing that can flip). Misread: > 6.
ATOL = {"fp4": 5e-2, "fp8": 0.5}


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x as e4m3 per token and group of `group` inputs (the last group may be partial)."""
    parts = [
        fake_quant(part, part.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX)
        for part in x.split(group, dim=-1)
    ]
    return torch.cat(parts, dim=-1).to(x.dtype)


def runs_in_fp8(module_name: str, module: torch.nn.Module) -> bool:
    """Whether ATOM runs the HF module's GEMM in FP8 (wo_a runs dequantized, as the
    release's reference runs it)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    release = released_name(f"{module_name.removeprefix('model.')}.weight")
    return bool(FP8_LAYERS.search(release)) and ".wo_a." not in release


def quantizing_reference(folder, fp8_experts: bool):
    hf = load_hf(folder)
    for name, module in hf.named_modules():
        if runs_in_fp8(name, module) or (fp8_experts and name.endswith("mlp.experts")):
            module.register_forward_pre_hook(
                lambda _m, args: (quantize_per_token_group(args[0]), *args[1:])
            )
        if fp8_experts and name.endswith("mlp.experts"):
            gate = module._apply_gate
            module._apply_gate = lambda gate_up, gate=gate: quantize_per_token_group(gate(gate_up))
    return hf


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """expert_dtype -> (quantized, reference) folders, each written once."""
    made = {}

    def pair(expert_dtype: str):
        if expert_dtype not in made:
            folder = tmp_path_factory.mktemp(f"deepseek_v4_{expert_dtype}")
            source = write_v4(folder / "source", **WIDE)
            made[expert_dtype] = write_release_quantized_pair(source, folder, expert_dtype)
        return made[expert_dtype]

    return pair


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_release_checkpoint_matches_hf_on_its_dequantized_weights(pairs, expert_dtype):
    quantized, reference = pairs(expert_dtype)
    hf = quantizing_reference(reference, fp8_experts=expert_dtype == "fp8")
    check_against_hf(
        reference, prompt_lengths=[5, LONG, 23], decode_steps=3, atol=ATOL[expert_dtype],
        atom_folder=quantized, hf_model=hf,
    )  # fmt: skip


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_quantized_layers_stay_quantized_and_the_rest_does_not(pairs, expert_dtype):
    quantized, _ = pairs(expert_dtype)
    layer = PagedModel(quantized).model.model.layers[1]
    attn, experts = layer.attn, layer.ffn.experts
    for linear in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_b, attn.indexer.wq_b):
        assert linear.weight.dtype == torch.float8_e4m3fn
    assert layer.ffn.shared_experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    expected = {"fp4": torch.uint8, "fp8": torch.float8_e4m3fn}[expert_dtype]
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == expected
    for unquantized in (attn.wo_a, attn.compressor.wkv, attn.indexer.weights_proj, layer.ffn.gate):
        assert unquantized.weight.dtype == torch.float32


def test_engine_generates_as_hf_on_the_dequantized_weights(pairs):
    quantized, reference = pairs("fp4")
    hf = quantizing_reference(reference, fp8_experts=False)
    prompts = [random_prompts([LONG - 6], seed=9)[0], random_prompts([7], seed=2)[0]]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    llm = LLM(model=str(quantized), dtype="float32", skip_tokenizer_init=True, block_size=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _swap_nibbles(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if ".experts." not in name or not name.endswith(".weight"):
        return tensor
    raw = tensor.view(torch.uint8)
    return ((raw >> 4) | (raw << 4)).view(tensor.dtype)


def _flip(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return tensor.view(torch.uint8).flip(dim).view(tensor.dtype)  # e8m0 has no flip


def _flip_group_scales(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return _flip(tensor, -1) if ".experts." in name and name.endswith(".scale") else tensor


def _flip_block_scales(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return _flip(tensor, 0) if ".experts." not in name and name.endswith(".scale") else tensor


@pytest.mark.parametrize("misread", [_swap_nibbles, _flip_group_scales, _flip_block_scales])
def test_a_misread_layout_shows(pairs, tmp_path, misread):
    quantized, reference = pairs("fp4")  # both layouts: FP8 blocks, FP4 groups
    tensors = load_file(quantized / "model.safetensors")
    save_file(
        {name: misread(name, t) for name, t in tensors.items()}, tmp_path / "model.safetensors"
    )
    (tmp_path / "config.json").write_text((quantized / "config.json").read_text())
    prompt = random_prompts([LONG], seed=5)[0]
    expected = hf_logits(quantizing_reference(reference, fp8_experts=False), prompt)
    paged = PagedModel(tmp_path)
    logits = paged.runner.run(
        [StepInput(prompt, 0, [paged.pages_for([], len(prompt))])], all_positions=True
    )
    assert (logits - expected).abs().max() > 20 * ATOL["fp4"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fmt": "e5m2"}, "config field quantization_config.fmt='e5m2' is not supported"),
        (
            {"scale_fmt": "e4m3"},
            "config field quantization_config.scale_fmt='e4m3' is not supported",
        ),
        (
            {"expert_dtype": "int4"},
            "config field quantization_config.expert_dtype='int4' is not supported",
        ),
        (
            {"weight_block_size": [64, 64]},
            "config field quantization_config.weight_block_size=[64, 64] is not supported",
        ),
        (
            {"weight_block_size": None},
            "config field quantization_config.weight_block_size=None is not supported",
        ),
        (
            {"quant_method": "mxfp4"},
            "config field quantization_config.quant_method='mxfp4' is not supported",
        ),
    ],
)
def test_a_quantization_atom_lacks_fails_at_load_naming_the_field(tmp_path, change, message):
    folder = write_checkpoint(tiny_config(ARCHITECTURE), tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {**release_quantization_config("fp4"), **change}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as error:
        build_model(ModelConfig.from_pretrained(folder), "cpu", progress=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_release_names_expert_dtype_at_the_top_level(tmp_path):
    folder = write_checkpoint(tiny_config(ARCHITECTURE), tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = release_quantization_config("fp4")
    raw["expert_dtype"] = "bf16"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"quantization_config.expert_dtype='bf16' is not"):
        build_model(ModelConfig.from_pretrained(folder), "cpu", progress=False)


def test_fp4_experts_without_expert_dtype_fail_naming_the_field(pairs, tmp_path):
    """A release's FP4 experts under a config that leaves out expert_dtype read as FP8
    (the default); the load fails on the first expert tensor, pointing at the field."""
    quantized, _ = pairs("fp4")
    (tmp_path / "model.safetensors").symlink_to(quantized / "model.safetensors")
    raw = json.loads((quantized / "config.json").read_text())
    raw.pop("expert_dtype", None)
    raw["quantization_config"].pop("expert_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as error:
        build_model(ModelConfig.from_pretrained(tmp_path), "cpu", progress=False)
    assert "experts stored as FP4 need expert_dtype 'fp4'" in str(error.value)
    assert "\n" not in str(error.value)
