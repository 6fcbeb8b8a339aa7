"""MoE routing, the fused expert computation and the FusedMoE layer against HF's modules
and naive loops."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from atom.distributed import SingleProcessGroup, get_tp_group, set_tp_group
from atom.kernels.fp8 import dequantize_fp8, quantize_fp8_per_block, quantize_fp8_per_tensor
from atom.kernels.moe import fused_moe, grouped_topk, topk_softmax
from atom.layers.moe import FusedMoE
from atom.loader import check_all_loaded, load_with_mapping


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


def hf_router(arch: str, top_k: int, renormalize: bool) -> torch.nn.Module:
    if arch == "mixtral":  # Mixtral always renormalises
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        config = MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=top_k)
        return MixtralTopKRouter(config)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=renormalize
    )
    return Qwen3MoeTopKRouter(config)


@pytest.mark.parametrize(
    "arch, top_k, renormalize",
    [("qwen3", 1, False), ("qwen3", 2, True), ("qwen3", 4, False), ("qwen3", 4, True),
     ("mixtral", 1, True), ("mixtral", 2, True)],
)  # fmt: skip
def test_topk_softmax_matches_hf_router(arch, top_k, renormalize):
    router = hf_router(arch, top_k, renormalize)
    torch.nn.init.normal_(router.weight)
    logits, hf_weights, hf_ids = router(torch.randn(11, 16))
    weights, ids = topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())


def naive_grouped_topk(logits, top_k, groups, topk_group, renormalize, scoring, bias, factor):
    """One token at a time, straight from the DeepSeek papers' description."""
    all_weights, all_ids = [], []
    for row in logits.float():
        scores = row.sigmoid() if scoring == "sigmoid" else row.softmax(-1)
        choice = scores if bias is None else scores + bias
        candidates = list(range(len(row)))
        if groups:
            size = len(row) // groups
            members = [candidates[g * size : (g + 1) * size] for g in range(groups)]
            # V3 (biased) ranks a group by its best two choices, V2 by its best one.
            best = 2 if bias is not None else 1
            rank = [sorted((float(choice[e]) for e in m), reverse=True)[:best] for m in members]
            kept = sorted(range(groups), key=lambda g: -sum(rank[g]))[:topk_group]
            candidates = [e for g in kept for e in members[g]]
        ids = sorted(candidates, key=lambda e: -float(choice[e]))[:top_k]
        weights = scores[ids]
        if renormalize:
            weights = weights / weights.sum()
        all_weights.append(weights * factor)
        all_ids.append(ids)
    return torch.stack(all_weights), torch.tensor(all_ids)


@pytest.mark.parametrize(
    "scoring, groups, topk_group, with_bias, renormalize",
    [("sigmoid", 4, 2, True, True), ("sigmoid", 8, 3, True, False), ("sigmoid", None, None, True, True),
     ("softmax", 4, 1, False, True), ("softmax", None, None, False, False)],
)  # fmt: skip
def test_grouped_topk_matches_naive_loop(scoring, groups, topk_group, with_bias, renormalize):
    torch.manual_seed(0)
    logits = torch.randn(15, 16)
    bias = torch.randn(16) / 4 if with_bias else None
    args = (4, groups, topk_group, renormalize, scoring, bias, 1.75)
    weights, ids = grouped_topk(logits, *args)
    want_weights, want_ids = naive_grouped_topk(logits, *args)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), want_weights.gather(1, want_order.indices)
    )


def hf_moe_with_routing(moe: torch.nn.Module, x: torch.Tensor, weights, ids) -> torch.Tensor:
    """What an HF DeepSeek MoE block outputs if tokens go to experts `ids` with `weights`:
    its own routed experts (3D `gate_up_proj`/`down_proj`, SiLU) plus its shared experts."""
    assert moe.config.hidden_act == "silu"
    flat = x.reshape(-1, x.shape[-1])
    routed = naive_moe(flat, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)
    return (routed + moe.shared_experts(flat)).view_as(x)


def randomize_hf_moe(moe: torch.nn.Module) -> None:
    # Experts are allocated with torch.empty and some HF versions zero the router.
    torch.nn.init.normal_(moe.gate.weight)
    torch.nn.init.normal_(moe.experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(moe.experts.down_proj, std=0.3)


@torch.no_grad()
def test_grouped_topk_matches_hf_deepseek_v3():
    """ATOM's routing, fed through HF's own experts, reproduces HF's whole DeepseekV3MoE block
    (a wrong expert or weight changes the output far beyond the tolerance)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
    )  # fmt: skip
    moe = DeepseekV3MoE(config)
    randomize_hf_moe(moe)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias, std=0.5)
    x = torch.randn(13, 32)
    logits = F.linear(x, moe.gate.weight.float())
    weights, ids = grouped_topk(
        logits, 4, 4, 2, True, "sigmoid", moe.gate.e_score_correction_bias, 2.5
    )
    torch.testing.assert_close(
        moe(x), hf_moe_with_routing(moe, x, weights, ids), atol=1e-4, rtol=1e-4
    )


@torch.no_grad()
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_grouped_topk_matches_hf_deepseek_v2(method):
    """As above for DeepseekV2Moe (softmax scores, V2's greedy and group-limited routing)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    torch.manual_seed(0)
    config = DeepseekV2Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, topk_method=method, routed_scaling_factor=1.5, n_shared_experts=1,
    )  # fmt: skip
    moe = DeepseekV2Moe(config)
    moe.num_experts = 8  # HF 5.12's group_limited_greedy path reads this unset attribute
    randomize_hf_moe(moe)
    x = torch.randn(1, 9, 32)  # HF 5.12's V2 router wants [batch, seq, hidden]
    logits = F.linear(x[0], moe.gate.weight.float())
    groups = 4 if method == "group_limited_greedy" else None
    weights, ids = grouped_topk(logits, 3, groups, 2, False, "softmax", None, 1.5)
    torch.testing.assert_close(
        moe(x), hf_moe_with_routing(moe, x, weights, ids), atol=1e-4, rtol=1e-4
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


@pytest.mark.parametrize("granularity", ["per-expert", "per-row"])
def test_fused_moe_fp8_per_tensor_matches_dequantized_experts(granularity):
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 4, 32, 24, 9
    w13 = torch.randn(experts, 2 * inter, hidden) / 8
    w2 = torch.randn(experts, hidden, inter) / 8
    q13, s13 = map(torch.stack, zip(*(quantize_fp8_per_tensor(w) for w in w13)))
    q2, s2 = map(torch.stack, zip(*(quantize_fp8_per_tensor(w) for w in w2)))
    if granularity == "per-expert":
        s13, s2 = s13.view(experts), s2.view(experts)
    else:  # what the FP8 MoE method hands over after merging gate and up scales
        s13 = s13.view(experts, 1, 1).expand(experts, 2 * inter, 1)
        s2 = s2.view(experts, 1, 1).expand(experts, hidden, 1)
    x = torch.randn(tokens, hidden)
    weights, ids = topk_softmax(torch.randn(tokens, experts), 2, True)
    got = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    want = naive_moe(x, dequantize_fp8(q13, s13.reshape(experts, -1, 1)),
                     dequantize_fp8(q2, s2.reshape(experts, -1, 1)), weights, ids)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class ShardGroup(SingleProcessGroup):
    """One rank of a TP group whose all-reduce the test does by hand."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


@contextmanager
def tp_group(group):
    previous = get_tp_group()
    set_tp_group(group)
    try:
        yield
    finally:
        set_tp_group(previous)


def expert_checkpoint(w13, w2, prefix="mlp"):
    """Per-expert tensors named as Qwen3-MoE checkpoints name them."""
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        yield f"{prefix}.experts.{e}.gate_proj.weight", w13[e, :inter]
        yield f"{prefix}.experts.{e}.up_proj.weight", w13[e, inter:]
        yield f"{prefix}.experts.{e}.down_proj.weight", w2[e]


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_moe_layer_loads_per_expert_checkpoint(world_size):
    # 12 experts: expert 1's names must not also catch expert 11's tensors.
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 12, 16, 8, 7
    w13 = torch.randn(experts, 2 * inter, hidden) / 4
    w2 = torch.randn(experts, hidden, inter) / 4
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", experts)
    out = torch.zeros(tokens, hidden)
    for rank in range(world_size):
        with tp_group(ShardGroup(rank, world_size)):
            model = torch.nn.Module()
            model.mlp = torch.nn.Module()
            model.mlp.experts = FusedMoE(experts, 3, hidden, inter, prefix="mlp.experts")
            loaded = load_with_mapping(model, expert_checkpoint(w13, w2), experts=mapping)
            check_all_loaded(model, loaded)
            out += model.mlp.experts(x, logits)  # the all-reduce over ranks
    weights, ids = topk_softmax(logits, 3, True)
    torch.testing.assert_close(out, naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def gpt_oss_experts(num_experts: int, hidden: int, inter: int, limit: float):
    """HF's GptOssExperts with random weights and biases, and the same experts in ATOM's
    layout: gate/up interleaved along HF's last dim become w13's gate rows then up rows."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
        swiglu_limit=limit,
    )  # fmt: skip
    experts = GptOssExperts(config)
    experts.alpha, experts.limit = 1.702, limit  # transformers 5.12 hardcodes them
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.5)
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], rows interleaved
    w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    b13 = experts.gate_up_proj_bias.detach()
    b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    return experts, (w13, w2, b13, experts.down_proj_bias.detach())


@pytest.mark.parametrize("limit", [7.0, 0.5])  # 0.5 clamps most gate and up values
def test_fused_moe_clamped_swiglu_with_biases_matches_hf_gpt_oss(limit):
    from atom.kernels.activation import ClampedSwiGLU

    torch.manual_seed(0)
    experts, (w13, w2, b13, b2) = gpt_oss_experts(8, 32, 24, limit)
    x = torch.randn(13, 32)
    weights, ids = topk_softmax(torch.randn(13, 8), 4, True)
    with torch.no_grad():
        want = experts(x, ids.long(), weights)
    got = fused_moe(x, w13, w2, weights, ids, ClampedSwiGLU(1.702, limit), w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_moe_rejects_an_unknown_activation():
    x = torch.randn(2, 8)
    weights, ids = topk_softmax(torch.randn(2, 4), 2, True)
    with pytest.raises(ValueError, match="unsupported MoE activation 'gelu'"):
        fused_moe(x, torch.randn(4, 12, 8), torch.randn(4, 8, 6), weights, ids, "gelu")
