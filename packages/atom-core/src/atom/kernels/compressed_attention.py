"""DeepSeek-V4's compressed attention over paged caches: where the compressed KV entries
live, the indexer's selection of them, and the attention (torch references).

A layer compressing every `rate` tokens keeps its entries in a cache tensor [num_blocks,
entries_per_page, width], on a block table of the sequence (its rows' own, or the native
engine's entry group's, `entry_table`: a table maps positions to pages alike): entry w
lives in the page of the token that closes it (position w * rate + rate - 1), so it
depends only on tokens of that page and the ones before it. Prefix caching and freeing then follow the token
pages: a cached page carries every entry its tokens closed, and a page shared by a prefix
hit is never written again. A page of B tokens closes B / rate entries (at least one page
in rate / B holds one when B < rate); B and rate are powers of two.

The attention is multi-query with one K = V head: each query attends, in one softmax with
its head's sink, over the K = V rows of its sliding window and the entries it may see
(every closed one, or those its indexer chose: `compressed_entry_topk`).
"""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.indexer import best_positions
from atom.kernels.mla import query_positions, sequence_spans
from atom.kernels.paged_attention import (
    attention_mask,
    dense_attention,
    first_window_page,
    gather_pages,
)
from atom.kernels.policy import dispatch, register


def entries_per_page(rate: int, block_size: int) -> int:
    return max(1, block_size // rate)


def entry_slots(
    table_row: torch.Tensor, entries: torch.Tensor, rate: int, block_size: int
) -> torch.Tensor:
    """Rows of the flattened entry cache [num_blocks * entries_per_page, width] that hold
    `entries` [n] of one sequence (its block table row)."""
    per_page = entries_per_page(rate, block_size)
    closing = entries * rate + rate - 1
    return table_row[closing // block_size].long() * per_page + entries % per_page


def token_slots(table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows of a flattened per-token cache [num_blocks * block_size, width] at `positions`."""
    return table_row[positions // block_size].long() * block_size + positions % block_size


def rows_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of `cache` [num_blocks, per_page, width] at flat `slots` (page * per_page +
    row), read by (page, row): the cache may be a view whose pages are not adjacent."""
    per_page = cache.shape[1]
    return cache[slots // per_page, slots % per_page]


def read_entries(
    cache: torch.Tensor, table: torch.Tensor, entries: torch.Tensor, rate: int, block_size: int
) -> torch.Tensor:
    return rows_at(cache, entry_slots(table, entries, rate, block_size))


def select_entries(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """The lightning indexer over compressed entries: which of `keys` [n, Di] each query
    attends to, as entry indices [T, min(topk, n)] (-1: none). score(t, s) = sum_h
    weights[t, h] * relu(q[t, h] . k[s]) (weights [T, Hi] fp32 hold both scales); query t
    sees the first visible[t] entries and keeps the `topk` best, equal scores to the
    earlier entry (atom.kernels.indexer)."""
    num_entries = keys.shape[0]
    if num_entries == 0:
        return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    per_head = torch.relu(torch.einsum("thd,sd->ths", q.float(), keys.float()))
    scores = torch.einsum("th,ths->ts", weights.float(), per_head)
    seen = torch.arange(num_entries, device=q.device)[None, :] < visible[:, None]
    best = best_positions(scores.masked_fill(~seen, float("-inf")), min(topk, num_entries))
    return torch.where(best < visible[:, None], best, -1)


def chosen_mask(chosen: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Entry indices [T, k] (-1: none) as a mask [T, num_entries]."""
    # -1 goes to a column past the end, so that no write to a real column is a False.
    index = torch.where(chosen >= 0, chosen, num_entries).long()
    mask = torch.zeros(chosen.shape[0], num_entries + 1, dtype=torch.bool, device=chosen.device)
    return mask.scatter_(1, index, True)[:, :num_entries]


@register("compressed_entry_topk", "torch")
def compressed_entry_topk_torch(q, weights, index_cache, metadata, rate, block_size, topk, out):
    out.fill_(-1)
    for i, begin, end, seq_len in sequence_spans(metadata, 0, metadata.num_seqs):
        entries = torch.arange(seq_len // rate, device=q.device)
        keys = read_entries(index_cache, metadata.block_table[i], entries, rate, block_size)
        visible = (query_positions(begin, end, seq_len, q.device) + 1) // rate
        chosen = select_entries(q[begin:end], weights[begin:end], keys, visible, topk)
        out[begin:end, : chosen.shape[1]] = chosen
    return out


def compressed_entry_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    metadata: AttentionMetadata,
    rate: int,
    block_size: int,
    topk: int,
) -> torch.Tensor:
    """Each query token's `topk` best closed entries by the indexer's score, as entry
    indices [T, topk] int32 (-1: none). q [T, Hi, Di] (rotated), weights [T, Hi] fp32;
    index_cache holds the indexer's entries, every `rate` tokens one, on pages of
    `block_size` tokens."""
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    return dispatch("compressed_entry_topk", q.device)(
        q, weights, index_cache, metadata, rate, block_size, topk, out
    )


@register("compressed_attention", "torch")
def compressed_attention_torch(
    q, kv_cache, entry_cache, metadata, window, rate, chosen, scale, sinks, out, entry_table=None
):  # fmt: skip
    block_size = kv_cache.shape[1]
    entry_table = metadata.block_table if entry_table is None else entry_table
    for i, begin, end, seq_len in sequence_spans(metadata, 0, metadata.num_seqs):
        table = metadata.block_table[i]
        positions = query_positions(begin, end, seq_len, q.device)
        first_page = first_window_page(seq_len - (end - begin), window, block_size)
        keys = [gather_pages(kv_cache, table, seq_len, first_page)]
        masks = [attention_mask(positions, seq_len, window, first_page * block_size)]
        if entry_cache is not None:
            entries = torch.arange(seq_len // rate, device=q.device)
            keys.append(read_entries(entry_cache, entry_table[i], entries, rate, block_size))
            if chosen is None:  # every closed entry: w closes at w * rate + rate - 1
                masks.append(entries[None, :] < (positions[:, None] + 1) // rate)
            else:
                masks.append(chosen_mask(chosen[begin:end], len(entries)))
        keys = torch.cat(keys).unsqueeze(1)  # one K = V head
        out[begin:end] = dense_attention(
            q[begin:end], keys, keys, torch.cat(masks, dim=1), scale, None, sinks
        )
    return out


def compressed_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    window: int,
    scale: float,
    sinks: torch.Tensor,
    entry_cache: torch.Tensor | None = None,
    rate: int = 0,
    chosen: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    entry_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (T: the step's tokens) over each query's last `window` K = V rows of
    kv_cache [num_blocks, block_size, D] and, with an entry_cache [num_blocks,
    entries_per_page, D] of one entry every `rate` tokens, the closed entries it sees: all
    of them, or the indices `chosen` [T, K] (-1: none). sinks [H]: each head's sink logit.
    -> [T, H, D]; `out`, where given, must hold zeros for a token past the step's
    sequences (a host's padding). The entries' pages are in `entry_table` [B, max_blocks]
    where they have a block table of their own (the native engine's entry group), else in
    the metadata's."""
    if out is None:
        out = torch.zeros_like(q)
    return dispatch("compressed_attention", q.device)(
        q, kv_cache, entry_cache, metadata, window, rate, chosen, scale, sinks, out, entry_table
    )
