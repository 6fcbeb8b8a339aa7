"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5).

Each layer keeps one indexer key per token (index_head_dim channels, shared by the
indexer's heads) in a paged cache beside its latent cache: [num_blocks, block_size, Di],
addressed by the same block table and slot mapping. A query token t scores every key s it
may see (s <= its position) as

    score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s])

with per-head weights w that already hold the softmax scale (Di^-0.5) and Hi^-0.5, and
keeps the `topk` best, equal scores to the earlier position (`best_positions`). The
selection is returned as cache slots [T, topk] (page * block_size + offset, -1 where a
token sees fewer than topk keys), which sparse MLA (atom.kernels.sparse_mla) reads
directly, whatever host laid out the pages.
"""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.kv_cache import dequantize_kv, quantize_kv
from atom.kernels.mla import query_positions, sequence_spans
from atom.kernels.paged_attention import gather_pages
from atom.kernels.policy import dispatch, register


@register("write_indexer_keys", "torch")
def write_indexer_keys_torch(keys, key_cache, slot_mapping, scale=1.0) -> None:
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache[slots // block_size, slots % block_size] = quantize_kv(
        keys[valid], scale, key_cache.dtype
    )


def write_indexer_keys(
    keys: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale: float = 1.0
) -> None:
    """keys [T, Di] into key_cache [num_blocks, block_size, Di]; slot -1 is padding."""
    dispatch("write_indexer_keys", keys.device)(keys, key_cache, slot_mapping, scale)


def best_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest of each score row [T, width], equal scores to the earlier position.

    torch.topk breaks ties by the row's width and layout, and equal scores are common
    (relu makes every key that no head scores above zero exactly 0): a verify step's rows
    span the draft positions too, masked, so topk would select other keys for the same
    query with speculation than without, and greedy tokens would differ. Each score is
    made a unique integer instead: its float32 bits mapped to integers of the same order,
    above the reversed position. A top-k of those is exact and costs what topk costs (a
    stable sort of the scores costs a sort)."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats run backwards
    width = scores.shape[-1]
    later_first = torch.arange(width - 1, -1, -1, device=scores.device)
    return ((ordered << 32) | later_first).topk(k, dim=-1).indices


def selected_slots(
    chosen: torch.Tensor, visible: torch.Tensor, table_row: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Token indices chosen [n, k] of one sequence as cache slots, -1 where the index is
    not visible ([n, 1] key counts)."""
    slots = table_row[chosen // block_size].long() * block_size + chosen % block_size
    return torch.where(chosen < visible, slots, -1)


@register("indexer_topk", "torch")
def indexer_topk_torch(q, weights, key_cache, metadata, topk, out, scale=1.0):
    block_size = key_cache.shape[1]
    out.fill_(-1)
    for i, begin, end, seq_len in sequence_spans(metadata, 0, metadata.num_seqs):
        table_row = metadata.block_table[i]
        keys = dequantize_kv(gather_pages(key_cache, table_row, seq_len), scale)
        per_head = torch.relu(torch.einsum("thd,sd->ths", q[begin:end].float(), keys))
        scores = torch.einsum("th,ths->ts", weights[begin:end].float(), per_head)
        positions = query_positions(begin, end, seq_len, q.device)
        keys_seen = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~keys_seen, float("-inf"))
        k = min(topk, seq_len)
        chosen = best_positions(scores, k)
        out[begin:end, :k] = selected_slots(chosen, positions[:, None] + 1, table_row, block_size)
    return out


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    metadata: AttentionMetadata,
    topk: int,
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The `topk` keys each query token scores highest, as cache slots [T, topk] int32.

    q [T, Hi, Di] (rotated), weights [T, Hi] (fp32, scales folded in); the new tokens'
    keys must already be in key_cache (`write_indexer_keys`). scale: an fp8 key cache's
    per-tensor scale.
    """
    if out is None:
        out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    return dispatch("indexer_topk", q.device)(q, weights, key_cache, metadata, topk, out, scale)
