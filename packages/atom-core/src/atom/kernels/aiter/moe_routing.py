"""Softmax top-k MoE routing (Mixtral, Qwen3-MoE) through aiter (aiter/ops/moe_op.py)."""

from __future__ import annotations

import aiter
import torch

from atom.kernels.aiter.common import next_backend
from atom.kernels.policy import capturable, register

_LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The case aiter's fused kernel is written for (Mixtral's 8, Qwen3-MoE's 128 experts);
# other expert counts are handed on rather than trust a generic path we have not checked.
_MAX_EXPERTS = 256


def _takes(router_logits: torch.Tensor, top_k: int) -> bool:
    num_tokens, num_experts = router_logits.shape
    return (
        num_tokens > 0
        and router_logits.dtype in _LOGIT_DTYPES
        and num_experts <= _MAX_EXPERTS
        and num_experts & (num_experts - 1) == 0
        and top_k <= num_experts
    )


@register("topk_softmax", "aiter")
@capturable
def topk_softmax_aiter(router_logits, top_k, renormalize):
    if not _takes(router_logits, top_k):
        return next_backend("topk_softmax", router_logits.device)(router_logits, top_k, renormalize)
    shape, device = (router_logits.shape[0], top_k), router_logits.device
    weights = torch.empty(shape, dtype=torch.float32, device=device)
    ids = torch.empty(shape, dtype=torch.int32, device=device)
    token_expert_indices = torch.empty(shape, dtype=torch.int32, device=device)  # unused
    # topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output, need_renorm)
    aiter.topk_softmax(weights, ids, token_expert_indices, router_logits.contiguous(), renormalize)
    return weights, ids
