"""Triton DeepSeek-V4 compressed attention (atom.kernels.compressed_attention): one
program per (query token, block of heads) folds, in one online softmax started from the
head's sink, the K = V rows of the token's sliding window (through the block table) and
then the compressed entries it sees (through the entries' table, `entry_table`): every
closed one (HCA, counted from its position) or its indexer's chosen ones (CSA, a list of
entry indices). Each row is loaded once per head block and serves as key and as value.

The selection scores every closed entry with the lightning indexer's kernel, the entries
being keys that sit in the page of their last token (atom.kernels.triton.indexer), then
keeps the top k as the reference does (`prefix_topk`, reading only the entries each token
sees, however wide the CUDA graphs' bound makes the score rows).

Decode and prefill tokens run the same programs, and every bound comes from device
tensors (`AttentionMetadata.query_token_bounds`): no host sync, so a CUDA graph can replay
a step. A prefill token reads its window from the pages itself; tiling a prefill's
queries over shared window rows is left to tuning.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from atom.kernels.policy import capturable, register
from atom.kernels.triton.indexer import index_scores, key_slots
from atom.kernels.triton.online_softmax import fold_block
from atom.kernels.triton.paged_attention import _load_page_rows
from atom.kernels.triton.prefix_topk import prefix_topk
from atom.kernels.triton.sparse_mla import load_slot_rows

# As sparse MLA's: 16 heads x 32 rows of D = 512 stay in registers; not yet tuned on an
# H100.
CONFIG = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}

# Which entries a query sees (the kernel's ENTRIES).
NO_ENTRIES = tl.constexpr(0)
EVERY_CLOSED_ENTRY = tl.constexpr(1)
CHOSEN_ENTRIES = tl.constexpr(2)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _fold_rows(q, rows, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(rows), input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    return fold_block(s, rows, m_i, l_i, acc, PRECISION)


@triton.jit
def _compressed_attention_kernel(
    q_ptr, kv_cache_ptr, entry_cache_ptr, chosen_ptr, sinks_ptr, out_ptr,
    block_table_ptr, entry_table_ptr, token_seq_ptr, token_keys_ptr,
    q_stride_t, q_stride_h, kv_stride_b, kv_stride_s, e_stride_b, e_stride_s,
    c_stride_t, o_stride_t, o_stride_h, bt_stride, et_stride,
    qk_scale, num_heads, head_dim, block_size, window, rate, per_page, pages_per_entry,
    num_chosen,
    ENTRIES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    # Keys the token sees: its position + 1 (0 for a host's padding, which sees nothing).
    num_keys = tl.load(token_keys_ptr + token)
    seq = tl.load(token_seq_ptr + token).to(tl.int64)
    table_row = block_table_ptr + seq * bt_stride
    entry_row = entry_table_ptr + seq * et_stride  # the entries' pages (their own group's)
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=head_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    # The sink: a first key of zero value.
    m_i = tl.load(sinks_ptr + heads, mask=head_valid, other=0.0).to(tl.float32) * LOG2E
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # No row (nor table entry) before the window is read: a sliding layer's may be freed.
    for start in range(tl.maximum(0, num_keys - window), num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < num_keys
        rows = _load_page_rows(
            kv_cache_ptr, table_row, n, valid, 0, kv_stride_b, kv_stride_s, 0, dims, dim_valid,
            block_size,
        ).to(q.dtype)  # fmt: skip
        m_i, l_i, acc = _fold_rows(q, rows, valid, m_i, l_i, acc, qk_scale, PRECISION)
    if ENTRIES == EVERY_CLOSED_ENTRY:
        for start in range(0, num_keys // rate, BLOCK_N):
            w = start + tl.arange(0, BLOCK_N)
            valid = w < num_keys // rate
            slots = key_slots(entry_row, w, valid, per_page, pages_per_entry)
            rows = load_slot_rows(
                entry_cache_ptr, slots, valid, e_stride_b, e_stride_s, dims, dim_valid, per_page
            ).to(q.dtype)
            m_i, l_i, acc = _fold_rows(q, rows, valid, m_i, l_i, acc, qk_scale, PRECISION)
    if ENTRIES == CHOSEN_ENTRIES:
        for start in range(0, num_chosen, BLOCK_N):
            k = start + tl.arange(0, BLOCK_N)
            w = tl.load(chosen_ptr + token * c_stride_t + k, mask=k < num_chosen, other=-1)
            valid = w >= 0
            slots = key_slots(entry_row, w, valid, per_page, pages_per_entry)
            rows = load_slot_rows(
                entry_cache_ptr, slots, valid, e_stride_b, e_stride_s, dims, dim_valid, per_page
            ).to(q.dtype)
            m_i, l_i, acc = _fold_rows(q, rows, valid, m_i, l_i, acc, qk_scale, PRECISION)
    o_ptrs = out_ptr + token * o_stride_t + heads[:, None] * o_stride_h + dims[None, :]
    out = acc / l_i[:, None]
    tl.store(
        o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & dim_valid[None, :]
    )


def pages_per_entry(rate: int, block_size: int) -> int:
    """Table entries an entry's tokens span (1 when a page holds whole windows)."""
    return max(1, rate // block_size)


@register("compressed_attention", "triton")
@capturable
def compressed_attention_triton(
    q, kv_cache, entry_cache, metadata, window, rate, chosen, scale, sinks, out, entry_table=None
):  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    token_seq, token_keys = metadata.query_token_bounds
    block_size = kv_cache.shape[1]
    if entry_cache is None:
        entries, entry_cache, rate = NO_ENTRIES, kv_cache, 1  # never read
    else:
        entries = EVERY_CLOSED_ENTRY if chosen is None else CHOSEN_ENTRIES
    if chosen is None:
        chosen = token_seq[:, None]  # never read
    entry_table = metadata.block_table if entry_table is None else entry_table
    block_h = min(CONFIG["block_h"], max(16, triton.next_power_of_2(num_heads)))
    _compressed_attention_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q, kv_cache, entry_cache, chosen, sinks, out,
        metadata.block_table, entry_table, token_seq, token_keys,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        entry_cache.stride(0), entry_cache.stride(1), chosen.stride(0),
        out.stride(0), out.stride(1), metadata.block_table.stride(0), entry_table.stride(0),
        scale * math.log2(math.e), num_heads, head_dim, block_size, window, rate,
        entry_cache.shape[1], pages_per_entry(rate, block_size), chosen.shape[1],
        ENTRIES=entries, BLOCK_H=block_h, BLOCK_N=CONFIG["block_n"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )  # fmt: skip
    return out


@register("compressed_entry_topk", "triton")
@capturable
def compressed_entry_topk_triton(q, weights, index_cache, metadata, rate, block_size, topk, out):
    # The score rows' width, the one shape taken from the host: under CUDA graphs every host
    # sets max_seq_len to its graphs' bound (native: the block table's tokens; vLLM:
    # max_model_len; SGLang: its table's), so a replay sees every closed entry.
    width = metadata.max_seq_len // rate
    out.fill_(-1)
    if q.shape[0] == 0 or width == 0:
        return out
    token_seq, token_keys = metadata.query_token_bounds
    visible = token_keys // rate
    scores = index_scores(
        q, weights, index_cache, metadata.block_table, token_seq, visible, width,
        pages_per_key=pages_per_entry(rate, block_size),
    )  # fmt: skip
    k = min(topk, width)
    prefix_topk(scores, visible, k, out=out[:, :k])
    return out
