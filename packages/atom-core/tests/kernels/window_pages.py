"""Batches whose out-of-window pages are freed, for the torch and Triton window tests.

With a sliding window the native engine frees a sequence's pages that lie wholly before
its earliest new query's window, leaving placeholders in the block table. Here those
entries point at a page of NaN: a kernel that reads one (even masked: 0 * NaN) returns
NaN, one that skips them returns exactly what it returns with the real pages.
"""

from __future__ import annotations

import random

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.paged_attention import first_window_page

# decode contexts, prefills (cached context, new tokens), page size, window
CASES = {
    "pages 4 in 16-key blocks": ([37, 60], [(50, 9), (23, 40)], 4, 21),
    "page 32 > block": ([80], [(100, 20)], 32, 13),
    "page 24 (nests neither way)": ([70], [(75, 30), (0, 60)], 24, 17),
    "page 1": ([30], [(40, 7)], 1, 9),
}
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def make_batch(case: str, device: str = "cpu", seed: int = 0):
    """(query, k_cache, v_cache, metadata with the real pages, metadata with the freed
    ones pointing at a NaN page, window)."""
    decodes, prefills, page_size, window = CASES[case]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * len(decodes) + [n for _, n in prefills]
    seq_lens = [c + 1 for c in decodes] + [c + n for c, n in prefills]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    pool = list(range(1, sum(pages_needed) + 1))  # page 0: the NaN page
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in pages_needed]
    num_pages = sum(pages_needed) + 1
    k_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, generator=gen)
    k_cache[0] = v_cache[0] = float("nan")
    freed_tables = []
    for table, q, s in zip(tables, query_lens, seq_lens):
        skipped = first_window_page(s - q, window, page_size)
        freed_tables.append([0] * skipped + table[skipped:])
    assert any(t[0] == 0 for t in freed_tables), "a case must free some page"
    slots = [
        table[p // page_size] * page_size + p % page_size
        for table, q, s in zip(tables, query_lens, seq_lens)
        for p in range(s - q, s)
    ]
    real = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=device)
    freed = AttentionMetadata.build(query_lens, seq_lens, freed_tables, slots, device=device)
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen)
    return query.to(device), k_cache.to(device), v_cache.to(device), real, freed, window
