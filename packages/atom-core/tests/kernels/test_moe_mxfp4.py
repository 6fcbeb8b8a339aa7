"""MXFP4 experts (torch reference and the FusedMoE layer) against HF: transformers'
own MXFP4 dequantization and its GptOssExperts module."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_moe import ShardGroup, gpt_oss_experts, tp_group

from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.moe import fused_moe_torch, topk_softmax
from atom.kernels.moe_mxfp4 import dequantize_mxfp4, fused_moe_mxfp4
from atom.layers.moe import FusedMoE
from atom.layers.quantization.mxfp4 import Mxfp4Config
from atom.loader import check_all_loaded, load_with_mapping
from atom.models.gpt_oss import per_expert_tensors
from atom.testing.mxfp4 import quantize_mxfp4


def hf_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, N, G, 16] / [E, N, G] -> [E, G * 32, N] (HF's transposed expert layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_dequantize_mxfp4_matches_hf():
    blocks = torch.arange(256, dtype=torch.uint8).view(2, 1, 8, 16)  # every byte
    scales = torch.tensor([100, 120, 126, 127, 128, 131, 140, 150], dtype=torch.uint8)
    scales = torch.stack([scales, scales.flip(0)]).view(2, 1, 8)
    torch.testing.assert_close(
        dequantize_mxfp4(blocks, scales).transpose(1, 2), hf_dequantize(blocks, scales)
    )


def mxfp4_gpt_oss_experts(num_experts: int, hidden: int, inter: int, limit: float):
    """HF's GptOssExperts holding the MXFP4 round trip (HF's dequantization) of random
    experts, and the checkpoint tensors that hold them (names relative to `experts.`)."""
    hf, _ = gpt_oss_experts(num_experts, hidden, inter, limit)
    checkpoint = {}
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(hf, name)
        blocks, scales = quantize_mxfp4(param.detach().transpose(1, 2))  # the Linear layout
        checkpoint[f"{name}_blocks"], checkpoint[f"{name}_scales"] = blocks, scales
        param.data.copy_(hf_dequantize(blocks, scales))
        checkpoint[f"{name}_bias"] = getattr(hf, f"{name}_bias").detach()
    return hf, checkpoint


def deinterleaved(checkpoint: dict, name: str) -> torch.Tensor:
    """gate_up rows (or bias entries) interleaved as GPT-OSS stores them -> gate, then up."""
    tensor = checkpoint[name]
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)


def routed(num_tokens: int, num_experts: int, top_k: int, hidden: int):
    x = torch.randn(num_tokens, hidden)
    weights, ids = topk_softmax(torch.randn(num_tokens, num_experts), top_k, True)
    return x, weights, ids


@pytest.mark.parametrize("limit", [7.0, 0.5])  # 0.5 clamps most gate and up values
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_moe_mxfp4_matches_hf_gpt_oss_experts(num_tokens, limit):
    torch.manual_seed(0)
    hf, ckpt = mxfp4_gpt_oss_experts(8, 64, 96, limit)
    x, weights, ids = routed(num_tokens, 8, 4, 64)
    with torch.no_grad():
        want = hf(x, ids.long(), weights)
    got = fused_moe_mxfp4(
        x, deinterleaved(ckpt, "gate_up_proj_blocks"), deinterleaved(ckpt, "gate_up_proj_scales"),
        ckpt["down_proj_blocks"], ckpt["down_proj_scales"], weights, ids,
        ClampedSwiGLU(1.702, limit), deinterleaved(ckpt, "gate_up_proj_bias"),
        ckpt["down_proj_bias"],
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)  # fp32 sums, in other orders


def test_bf16_reference_equals_dequantize_then_bf16_fused_moe():
    """Dequantizing only the routed experts, renumbered, computes exactly what the whole
    table dequantized to bf16 computes."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(16, 128, 64) / 8, torch.randn(16, 64, 64) / 8
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    bias13, bias2 = torch.randn(16, 128).bfloat16(), torch.randn(16, 64).bfloat16()
    x, weights, ids = routed(6, 16, 2, 64)  # at most 12 of the 16 experts
    x, act = x.bfloat16(), ClampedSwiGLU(1.702, 7.0)
    got = fused_moe_mxfp4(x, b13, s13, b2, s2, weights, ids, act, bias13, bias2)
    dense13, dense2 = (hf_dequantize(b, s).transpose(1, 2).bfloat16() for b, s in ((b13, s13), (b2, s2)))  # fmt: skip
    want = fused_moe_torch(x, dense13, dense2, weights, ids, act, None, None, None, bias13, bias2)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def gpt_oss_moe_layer(num_experts, top_k, hidden, inter, limit) -> torch.nn.Module:
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = FusedMoE(
        num_experts, top_k, hidden, inter, activation=ClampedSwiGLU(1.702, limit), bias=True,
        quant_config=Mxfp4Config(), prefix="mlp.experts",
    )  # fmt: skip
    return model


@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_keeps_experts_packed_and_shards_them(world_size):
    """The GPT-OSS checkpoint stream (per_expert_tensors) loads packed experts; two ranks
    (w13 split along its rows, w2 along whole groups of its input) sum to HF's experts."""
    torch.manual_seed(0)
    experts, top_k, hidden, inter, limit = 8, 4, 64, 128, 0.75
    hf, ckpt = mxfp4_gpt_oss_experts(experts, hidden, inter, limit)
    x, logits = torch.randn(9, hidden), torch.randn(9, experts)
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", experts)
    stream = [(f"mlp.experts.{name}", tensor) for name, tensor in ckpt.items()]
    out = torch.zeros(9, hidden)
    for rank in range(world_size):
        with tp_group(ShardGroup(rank, world_size)):
            model = gpt_oss_moe_layer(experts, top_k, hidden, inter, limit)
            loaded = load_with_mapping(model, per_expert_tensors(stream), experts=mapping)
            check_all_loaded(model, loaded)
            layer = model.mlp.experts
            assert not hasattr(layer, "w13_weight")
            rows = 2 * inter // world_size
            assert layer.w13_blocks.shape == (experts, rows, hidden // 32, 16)
            assert layer.w2_scales.shape == (experts, hidden, inter // world_size // 32)
            assert layer.w13_blocks.dtype == layer.w2_scales.dtype == torch.uint8
            out += layer(x, logits)  # the all-reduce over ranks
    weights, ids = topk_softmax(logits, top_k, True)
    with torch.no_grad():
        want = hf(x, ids.long(), weights)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5)


def test_tensor_parallel_size_that_splits_a_group_is_named():
    per_rank = r"intermediate size per rank \(16: .* size 4\)"  # 64 / 4 columns
    with tp_group(ShardGroup(0, 4)), pytest.raises(ValueError, match=per_rank):
        gpt_oss_moe_layer(8, 2, 64, 64, 7.0)


def test_mismatched_packed_tensor_is_named():
    (b13, s13), (b2, s2) = (
        quantize_mxfp4(torch.randn(4, 64, 64)),
        quantize_mxfp4(torch.randn(4, 64, 32)),
    )
    x, weights, ids = routed(3, 4, 2, 64)
    with pytest.raises(ValueError, match=r"w2_scales is torch.uint8 \(4, 48, 1\), expected"):
        fused_moe_mxfp4(x, b13, s13, b2, s2[:, :48], weights, ids)
