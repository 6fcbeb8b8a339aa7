"""MoE routing: top-k over softmax scores (Mixtral, Qwen3-MoE) and DeepSeek's grouped top-k.

Each program routes BLOCK_T tokens with the whole expert row in registers; the top k are
taken one at a time, so the ids come out in descending score order like torch.topk. No
host synchronisation: both are safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import capturable, register

_BLOCK_T = 4


@triton.jit
def _take_top(choice, expert, values, sel_w, sel_ids, slot, k_cols, NO_EXPERT: tl.constexpr):
    """Moves each row's best `choice` entry (lowest expert id on ties) to column `slot` of
    the selection, recording its `values` entry; all of choice/expert/values are [T, E]."""
    best = tl.max(choice, axis=1)
    idx = tl.min(tl.where(choice == best[:, None], expert, NO_EXPERT), axis=1)
    hit = expert == idx[:, None]
    value = tl.sum(tl.where(hit, values, 0.0), axis=1)
    sel_w = tl.where(k_cols[None, :] == slot, value[:, None], sel_w)
    sel_ids = tl.where(k_cols[None, :] == slot, idx[:, None], sel_ids)
    return tl.where(hit, float("-inf"), choice), sel_w, sel_ids


@triton.jit
def _store_selection(weights_ptr, ids_ptr, rows, num_tokens, k_cols, sel_w, sel_ids, TOP_K):
    offs = rows[:, None] * TOP_K + k_cols[None, :]
    mask = (rows < num_tokens)[:, None] & (k_cols < TOP_K)[None, :]
    tl.store(weights_ptr + offs, sel_w, mask=mask)
    tl.store(ids_ptr + offs, sel_ids, mask=mask)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Rows past the end re-read the last token (never stored), so no row is all -inf.
    safe_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    expert = tl.arange(0, BLOCK_E)[None, :]
    valid = expert < num_experts
    logits = tl.load(logits_ptr + safe_rows[:, None] * stride_t + expert, mask=valid)
    logits = tl.where(valid, logits.to(tl.float32), float("-inf"))
    exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exp / tl.sum(exp, axis=1)[:, None]
    # NaN scores (garbage activations, e.g. a host's dummy run over an unwritten cache)
    # must still select real experts: an id past the table would index out of bounds.
    choice = tl.where(valid & (probs == probs), probs, float("-inf"))
    k_cols = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    sel_ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for slot in tl.static_range(TOP_K):
        choice, sel_w, sel_ids = _take_top(
            choice, expert, probs, sel_w, sel_ids, slot, k_cols, BLOCK_E
        )
    if RENORMALIZE:
        sel_w = sel_w / tl.sum(sel_w, axis=1)[:, None]
    _store_selection(weights_ptr, ids_ptr, rows, num_tokens, k_cols, sel_w, sel_ids, TOP_K)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, stride_t, routed_scaling_factor,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    safe_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    group = tl.arange(0, BLOCK_G)[None, :, None]
    member = tl.arange(0, BLOCK_EG)[None, None, :]
    expert = group * GROUP_SIZE + member  # [1, G, E/G]: experts laid out group by group
    valid = (group < NUM_GROUPS) & (member < GROUP_SIZE)
    logits = tl.load(logits_ptr + safe_rows[:, None, None] * stride_t + expert, mask=valid)
    logits = tl.where(valid, logits.to(tl.float32), float("-inf"))
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.max(logits, axis=2), axis=1)
        exp = tl.exp(logits - row_max[:, None, None])
        scores = exp / tl.sum(tl.sum(exp, axis=2), axis=1)[:, None, None]
    choice = scores
    if HAS_BIAS:  # the bias steers selection only; weights stay the unbiased scores
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid & (choice == choice), choice, float("-inf"))  # NaN: see above
    if NUM_GROUPS > 1:
        best = tl.max(choice, axis=2)
        if HAS_BIAS:  # DeepSeek-V3 ranks a group by the sum of its two best experts
            first = tl.min(tl.where(choice == best[:, :, None], member, BLOCK_EG), axis=2)
            second = tl.max(tl.where(member == first[:, :, None], float("-inf"), choice), axis=2)
            group_score = best + second
        else:
            group_score = best
        groups = tl.arange(0, BLOCK_G)[None, :]
        group_score = tl.where(groups < NUM_GROUPS, group_score, float("-inf"))
        kept = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=1)
            g = tl.min(tl.where(group_score == top[:, None], groups, BLOCK_G), axis=1)
            kept = tl.where(groups == g[:, None], 1, kept)
            group_score = tl.where(groups == g[:, None], float("-inf"), group_score)
        choice = tl.where(kept[:, :, None] != 0, choice, float("-inf"))
    # Flatten [T, G, E/G] to [T, G * E/G] for the final top-k; padding gets no expert id.
    expert = tl.where(valid, expert, NUM_GROUPS * GROUP_SIZE)
    expert = tl.reshape(tl.broadcast_to(expert, choice.shape), (BLOCK_T, BLOCK_G * BLOCK_EG))
    choice = tl.reshape(choice, (BLOCK_T, BLOCK_G * BLOCK_EG))
    scores = tl.reshape(scores, (BLOCK_T, BLOCK_G * BLOCK_EG))
    k_cols = tl.arange(0, BLOCK_K)
    sel_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    sel_ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for slot in tl.static_range(TOP_K):
        choice, sel_w, sel_ids = _take_top(
            choice, expert, scores, sel_w, sel_ids, slot, k_cols, NUM_GROUPS * GROUP_SIZE
        )
    if RENORMALIZE:
        sel_w = sel_w / (tl.sum(sel_w, axis=1)[:, None] + 1e-20)
    sel_w = sel_w * routed_scaling_factor
    _store_selection(weights_ptr, ids_ptr, rows, num_tokens, k_cols, sel_w, sel_ids, TOP_K)


def _outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (router_logits.shape[0], top_k)
    device = router_logits.device
    return (
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.int32, device=device),
    )


@register("topk_softmax", "triton")
@capturable
def topk_softmax_triton(router_logits, top_k, renormalize):
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights, ids = _outputs(logits, top_k)
    if num_tokens:
        _topk_softmax_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            logits, weights, ids, num_tokens, num_experts, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=_BLOCK_T,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        )  # fmt: skip
    return weights, ids


@register("grouped_topk", "triton")
@capturable
def grouped_topk_triton(
    router_logits,
    top_k,
    num_expert_group,
    topk_group,
    renormalize,
    scoring_func,
    correction_bias,
    routed_scaling_factor,
):
    if scoring_func not in ("sigmoid", "softmax"):
        raise ValueError(f"unsupported MoE scoring function {scoring_func!r}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    groups = num_expert_group if num_expert_group and num_expert_group > 1 else 1
    weights, ids = _outputs(logits, top_k)
    if num_tokens:
        _grouped_topk_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            logits, logits if correction_bias is None else correction_bias, weights, ids,
            num_tokens, logits.stride(0), float(routed_scaling_factor),
            NUM_GROUPS=groups, GROUP_SIZE=num_experts // groups,
            TOPK_GROUP=topk_group if groups > 1 else 1, TOP_K=top_k, RENORMALIZE=renormalize,
            SIGMOID=scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None,
            BLOCK_T=_BLOCK_T, BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_EG=triton.next_power_of_2(num_experts // groups),
            BLOCK_K=triton.next_power_of_2(top_k),
        )  # fmt: skip
    return weights, ids
