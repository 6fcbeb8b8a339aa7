"""MLA that attends only to the tokens the indexer selected (DeepSeek Sparse Attention).

Every query token has its own key set, `topk_slots` [T, K] (cache slots, -1: none; from
atom.kernels.indexer), so prefill and decode tokens are alike: each is one latent-space
MQA over its K cache rows, in the weight-absorbed form (atom.kernels.mla explains it):
q_nope goes through W_UK, the step attends with head dim L + R against whole cache rows
and their first L channels as values, and the latent output goes through W_UV. With
K = 2048 keys per query the up-projected form would expand K rows per query; the
absorbed one reads each selected row once per token.
"""

from __future__ import annotations

import torch

from atom.kernels.kv_cache import dequantize_kv
from atom.kernels.mla import absorb_query, expand_latent_output
from atom.kernels.policy import dispatch, register

# Query tokens per reference step: bounds the gathered rows to [chunk, K, L + R].
REFERENCE_CHUNK = 256


@register("sparse_mla_attention", "torch")
def sparse_mla_attention_torch(q_latent, q_pe, kv_cache, topk_slots, scale, out, kv_scale=1.0):
    latent_dim = q_latent.shape[-1]
    rows = kv_cache.flatten(0, 1)
    query = torch.cat([q_latent, q_pe], dim=-1).float()
    for begin in range(0, query.shape[0], REFERENCE_CHUNK):
        slots = topk_slots[begin : begin + REFERENCE_CHUNK].long()
        valid = slots >= 0
        # -1 reads slot 0 and is zeroed: its page may hold anything (0 * NaN is NaN).
        keys = dequantize_kv(rows[slots.clamp(min=0)], kv_scale)  # [n, K, L + R]
        keys = keys.masked_fill(~valid[..., None], 0.0)
        scores = torch.einsum("nhc,nkc->nhk", query[begin : begin + len(slots)], keys) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        # A token with no key (padding) gets zeros rather than NaN.
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        latent = torch.einsum("nhk,nkl->nhl", probs, keys[..., :latent_dim])
        out[begin : begin + len(slots)] = latent.to(out.dtype)
    return out


def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Latent-space MQA of each query token over its selected cache rows -> [T, H, L].

    q_latent [T, H, L] (q_nope through W_UK), q_pe [T, H, R] (rotated); kv_cache is the
    latent cache [num_blocks, block_size, L + R]; topk_slots [T, K] int32.
    """
    if out is None:
        out = q_latent.new_empty(q_latent.shape)
    return dispatch("sparse_mla_attention", q_latent.device)(
        q_latent, q_pe, kv_cache, topk_slots, scale, out, kv_scale
    )


def sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    topk_slots: torch.Tensor,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Sparse MLA for a whole batch: q_nope [T, H, Dn], q_pe [T, H, R] -> [T, H, Dv]."""
    latent_out = sparse_mla_attention(
        absorb_query(q_nope, w_uk), q_pe, kv_cache, topk_slots, scale, kv_scale=kv_scale
    )
    return expand_latent_output(latent_out, w_uv)
