"""Mixture-of-experts routing and the fused expert computation (torch references)."""

from __future__ import annotations

import torch

from atom.kernels.activation import ClampedSwiGLU, silu_and_mul
from atom.kernels.fp8 import dequantize_fp8, fp8_scaled_mm, quantize_fp8_per_token_group
from atom.kernels.policy import capturable, dispatch, register


@register("topk_softmax", "torch")
@capturable
def topk_softmax_torch(router_logits, top_k, renormalize):
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Mixtral, Qwen3-MoE): (weights [T, k] fp32, expert ids [T, k] int32)."""
    return dispatch("topk_softmax", router_logits.device)(router_logits, top_k, renormalize)


@register("grouped_topk", "torch")
@capturable
def grouped_topk_torch(
    router_logits,
    top_k,
    num_expert_group,
    topk_group,
    renormalize,
    scoring_func,
    correction_bias,
    routed_scaling_factor,
):
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group and num_expert_group > 1:
        # Explicit sizes: a data-parallel rank with no tokens this step routes zero rows.
        grouped = choice.view(
            choice.shape[0], num_expert_group, choice.shape[1] // num_expert_group
        )
        # DeepSeek-V3 (biased) ranks groups by their two best experts; V2 by its best one.
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_expert_group: int | None,
    topk_group: int | None,
    renormalize: bool,
    scoring_func: str = "sigmoid",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: sigmoid (V3, with a selection-only bias) or softmax (V2) scores,
    top-k within the best `topk_group` of `num_expert_group` groups; the weights are the
    unbiased scores, optionally renormalised, times routed_scaling_factor."""
    return dispatch("grouped_topk", router_logits.device)(
        router_logits,
        top_k,
        num_expert_group,
        topk_group,
        renormalize,
        scoring_func,
        correction_bias,
        routed_scaling_factor,
    )


def _expert_linear(x, weight, scale, block_size, bias):
    if scale is None:
        y = x @ weight.T
    elif block_size is not None:
        x_q, x_scale = quantize_fp8_per_token_group(x, block_size[1])
        y = fp8_scaled_mm(x_q, x_scale, weight, scale, x.dtype, block_size=block_size)
    else:
        y = x @ dequantize_fp8(weight, scale, dtype=x.dtype).T
    return y if bias is None else y + bias


MoEActivation = str | ClampedSwiGLU
""""silu" (SwiGLU) or a ClampedSwiGLU (GPT-OSS)."""


def check_moe_activation(activation: MoEActivation) -> None:
    if activation != "silu" and not isinstance(activation, ClampedSwiGLU):
        raise ValueError(
            f"unsupported MoE activation {activation!r}; supported: 'silu', ClampedSwiGLU"
        )


@register("fused_moe", "torch")
def fused_moe_torch(
    hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_size,
    w13_bias=None, w2_bias=None,
):  # fmt: skip
    check_moe_activation(activation)
    gated_activation = silu_and_mul if activation == "silu" else activation
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    order = flat_ids.argsort(stable=True)  # tokens grouped by expert
    experts, counts = flat_ids[order].unique_consecutive(return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        rows = order[start : start + count]
        start += count
        if expert >= w13.shape[0]:  # held by another expert-parallel rank
            continue
        tokens, slots = rows // topk_ids.shape[1], rows % topk_ids.shape[1]
        s13 = None if w13_scale is None else w13_scale[expert]
        s2 = None if w2_scale is None else w2_scale[expert]
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        act = gated_activation(_expert_linear(hidden[tokens], w13[expert], s13, block_size, b13))
        y = _expert_linear(act, w2[expert], s2, block_size, b2)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation = "silu",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{ids[t, k]}(hidden[t]) with gated experts.

    An id >= E (the experts in w13) names an expert that another expert-parallel rank
    holds (atom.layers.expert_parallel): that slot adds nothing here.

    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; optional biases w13_bias
    [E, 2I] and w2_bias [E, H] (GPT-OSS), the latter weighted like the expert's output.
    `activation` combines gate and up: "silu" or a ClampedSwiGLU. FP8 experts pass their
    scales: per expert [E] or per row [E, N, 1] (weights dequantized, activations stay as
    they are), or 128x128 blocks [E, N/128, K/128] with block_size (activations quantized
    per token group, as in the dense FP8 layers).
    """
    return dispatch("fused_moe", hidden.device)(
        hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_size,
        w13_bias, w2_bias,
    )  # fmt: skip
