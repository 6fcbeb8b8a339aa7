"""Triton lightning indexer (atom.kernels.indexer): the key write, and the scores of every
query token against the keys it sees, then top-k.

The score kernel runs one program per (query token, block of key positions): it reads the
token's Hi query heads once, a block of cached keys through the block table, and writes
sum_h w_h * relu(q_h . k) into a [T, width] score row; blocks past the token's keys write
nothing. Selection is the reference's over each row's keys (`prefix_topk`, as
`best_positions`: ties to the earlier position), then the chosen positions become cache
slots through the block table. Both steps take their bounds from device tensors
(`AttentionMetadata.query_token_bounds`); the width is the step's longest sequence, or
under CUDA graphs the graphs' bound, which costs only idle programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.policy import capturable, register
from atom.kernels.triton.kv_cache import write_kv_cache_triton
from atom.kernels.triton.prefix_topk import prefix_topk
from atom.kernels.triton.sparse_mla import load_slot_rows

BLOCK_N = 64


@register("write_indexer_keys", "triton")
@capturable
def write_indexer_keys_triton(keys, key_cache, slot_mapping, scale=1.0) -> None:
    # The key cache seen as a one-head K/V pair of the two halves of each row (the KV-write
    # kernel writes both), as write_mla_cache does with latent and rope.
    half = keys.shape[-1] // 2
    rows = key_cache.unsqueeze(2)
    write_kv_cache_triton(
        keys[:, None, :half], keys[:, None, half:], rows[..., :half], rows[..., half:],
        slot_mapping, scale, scale,
    )  # fmt: skip


@triton.jit
def key_slots(table_row_ptr, n, valid, per_page, pages_per_key):
    """Flat cache slots (page * per_page + row) of keys n of one sequence, where key n sits
    in table entry (n // per_page) * pages_per_key + pages_per_key - 1: a token's key has
    one row of its page (pages_per_key 1); a compressed entry lives in the page of the
    last of its tokens, which may span several pages (atom.kernels.compressed_attention)."""
    table_index = (n // per_page) * pages_per_key + pages_per_key - 1
    page = tl.load(table_row_ptr + table_index, mask=valid, other=0).to(tl.int64)
    return page * per_page + n % per_page


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, cache_ptr, scores_ptr, block_table_ptr, token_seq_ptr, token_keys_ptr,
    q_stride_t, q_stride_h, w_stride_t, c_stride_b, c_stride_s, s_stride_t, bt_stride,
    num_heads, head_dim, per_page, pages_per_key, width, key_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    num_keys = tl.load(token_keys_ptr + token)
    if tl.program_id(1) * BLOCK_N >= num_keys:
        return  # the top-k reads only each row's keys
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    n_valid = n < num_keys
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads < num_heads
    dim_valid = dims < head_dim
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=head_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    slots = key_slots(block_table_ptr + seq * bt_stride, n, n_valid, per_page, pages_per_key)
    keys = load_slot_rows(
        cache_ptr, slots, n_valid, c_stride_b, c_stride_s, dims, dim_valid, per_page
    ).to(q.dtype)
    per_head = tl.maximum(tl.dot(q, tl.trans(keys), input_precision=PRECISION), 0.0)
    weights = tl.load(w_ptr + token * w_stride_t + heads, mask=head_valid, other=0.0)
    scores = tl.sum(per_head * weights[:, None], 0) * key_scale
    tl.store(scores_ptr + token * s_stride_t + n, scores, mask=n_valid & (n < width))


def index_scores(q, weights, key_cache, block_table, token_seq, token_keys, width,
                 key_scale=1.0, pages_per_key=1):  # fmt: skip
    """sum_h w_h relu(q_h . k) of every query token [T] against its sequence's first
    token_keys[t] keys of key_cache -> [T, width] fp32, unwritten past them."""
    num_tokens, num_heads, head_dim = q.shape
    scores = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    _indexer_scores_kernel[(num_tokens, triton.cdiv(width, BLOCK_N))](
        q, weights, key_cache, scores, block_table, token_seq, token_keys,
        q.stride(0), q.stride(1), weights.stride(0), key_cache.stride(0), key_cache.stride(1),
        scores.stride(0), block_table.stride(0),
        num_heads, head_dim, key_cache.shape[1], pages_per_key, width, key_scale,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return scores


@register("indexer_topk", "triton")
@capturable
def indexer_topk_triton(q, weights, key_cache, metadata, topk, out, scale=1.0):
    # Under CUDA graphs every host sets max_seq_len to its graphs' bound
    # (compressed_entry_topk says which); the top-k reads only each token's keys.
    width = metadata.max_seq_len
    out.fill_(-1)
    if q.shape[0] == 0 or width == 0:
        return out
    token_seq, token_keys = metadata.query_token_bounds
    key_scale = scale if is_fp8_kv_cache(key_cache) else 1.0  # relu(c x) = c relu(x), c > 0
    scores = index_scores(
        q, weights, key_cache, metadata.block_table, token_seq, token_keys, width, key_scale
    )
    k = min(topk, width)
    chosen = prefix_topk(scores, token_keys, k)
    tables = metadata.block_table[token_seq.long()]
    block_size = key_cache.shape[1]
    pages = tables.gather(1, (chosen.clamp(min=0) // block_size).long())
    slots = pages.long() * block_size + chosen % block_size
    out[:, :k] = torch.where(chosen >= 0, slots, -1)
    return out
