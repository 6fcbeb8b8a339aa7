"""Paged storage of DeepSeek-V4's compressed KV entries, and its indexer's selection
(torch references).

A layer compressing every `rate` tokens keeps its entries on the sequence's own block
table, in a cache tensor [num_blocks, entries_per_page, width]: entry w lives in the page
of the token that closes it (position w * rate + rate - 1), so it depends only on tokens
of that page and the ones before it. Prefix caching and freeing then follow the token
pages: a cached page carries every entry its tokens closed, and a page shared by a prefix
hit is never written again. A page of B tokens closes B / rate entries (at least one page
in rate / B holds one when B < rate); B and rate are powers of two.
"""

from __future__ import annotations

import torch

from atom.kernels.indexer import best_positions


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


def select_entries(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """The lightning indexer over compressed entries: which of `keys` [n, Di] each query
    attends to, as a mask [T, n]. score(t, s) = sum_h weights[t, h] * relu(q[t, h] . k[s])
    (weights [T, Hi] fp32 hold both scales); query t sees the first visible[t] entries and
    keeps the `topk` best, equal scores to the earlier entry (atom.kernels.indexer)."""
    num_entries = keys.shape[0]
    chosen = torch.zeros(q.shape[0], num_entries, dtype=torch.bool, device=q.device)
    if num_entries == 0:
        return chosen
    per_head = torch.relu(torch.einsum("thd,sd->ths", q.float(), keys.float()))
    scores = torch.einsum("th,ths->ts", weights.float(), per_head)
    seen = torch.arange(num_entries, device=q.device)[None, :] < visible[:, None]
    best = best_positions(scores.masked_fill(~seen, float("-inf")), min(topk, num_entries))
    return chosen.scatter_(1, best, best < visible[:, None])
