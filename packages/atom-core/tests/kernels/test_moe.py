"""MoE routing and the fused expert computation against HF's modules and naive loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.fp8 import dequantize_fp8, quantize_fp8_per_block
from atom.kernels.moe import fused_moe, grouped_topk, topk_softmax


def naive_moe(x, w13, w2, weights, ids, quantize_input=lambda v: v):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e] @ quantize_input(x[t])).chunk(2)
            out[t] += weights[t, k] * (w2[e] @ quantize_input(F.silu(gate) * up))
    return out


def fake_quant_groups(v: torch.Tensor, group: int = 128) -> torch.Tensor:
    """e4m3 round trip with one amax/448 scale per 128 consecutive values."""
    groups = v.view(-1, group)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view_as(v)


@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (4, False), (4, True)])
def test_topk_softmax_matches_hf_qwen3_router(top_k, renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=renormalize
    )
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())


def test_grouped_topk_matches_hf_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
    )  # fmt: skip
    moe = DeepseekV3MoE(config)
    torch.nn.init.normal_(moe.gate.weight)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias, std=0.5)
    logits = torch.randn(13, 16)
    hf_ids, hf_weights = moe.route_tokens_to_experts(logits)
    weights, ids = grouped_topk(
        logits, 4, 4, 2, True, "sigmoid", moe.gate.e_score_correction_bias, 2.5
    )
    order, hf_order = ids.long().sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_grouped_topk_matches_hf_deepseek_v2(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    config = DeepseekV2Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, topk_method=method, routed_scaling_factor=1.5, n_shared_experts=1,
    )  # fmt: skip
    moe = DeepseekV2Moe(config)
    moe.num_experts = 8  # HF 5.12's group_limited_greedy path reads this unset attribute
    logits = torch.randn(9, 8)
    hf_ids, hf_weights = moe.route_tokens_to_experts(logits[None])
    groups = 4 if method == "group_limited_greedy" else None
    weights, ids = grouped_topk(logits, 3, groups, 2, False, "softmax", None, 1.5)
    order, hf_order = ids.long().sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices).float()
    )


@pytest.mark.parametrize("num_tokens, experts, top_k", [(1, 4, 1), (17, 8, 2), (33, 16, 4)])
def test_fused_moe_matches_naive_loop(num_tokens, experts, top_k):
    torch.manual_seed(0)
    hidden, inter = 32, 24
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) / 4
    w2 = torch.randn(experts, hidden, inter) / 4
    weights, ids = topk_softmax(torch.randn(num_tokens, experts), top_k, True)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids),
        naive_moe(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


def test_fused_moe_fp8_block_matches_dequantized_experts():
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 4, 256, 128, 9
    w13 = torch.randn(experts, 2 * inter, hidden) / 8
    w2 = torch.randn(experts, hidden, inter) / 8
    q13, s13 = zip(*(quantize_fp8_per_block(w) for w in w13))
    q2, s2 = zip(*(quantize_fp8_per_block(w) for w in w2))
    q13, s13, q2, s2 = map(torch.stack, (q13, s13, q2, s2))
    x = torch.randn(tokens, hidden)
    weights, ids = topk_softmax(torch.randn(tokens, experts), 2, True)
    got = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, block_size=(128, 128))
    deq13 = torch.stack([dequantize_fp8(q, s, (128, 128)) for q, s in zip(q13, s13)])
    deq2 = torch.stack([dequantize_fp8(q, s, (128, 128)) for q, s in zip(q2, s2)])
    want = naive_moe(x, deq13, deq2, weights, ids, quantize_input=fake_quant_groups)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
