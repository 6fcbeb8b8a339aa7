"""The lightning indexer's torch reference (atom.kernels.indexer) against naive math."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.dsa_batches import (
    BATCHES,
    INDEX_DIM,
    PagedBatch,
    check_selection,
    selection_case,
    tie_case,
)

from atom.kernels.indexer import indexer_topk, write_indexer_keys

TOPK = 8


@pytest.mark.parametrize("name", list(BATCHES))
def test_topk_matches_naive_scores(name):
    batch = PagedBatch(*BATCHES[name])
    q, w, keys, cache = selection_case(batch)
    slots = indexer_topk(batch.new_rows(q), batch.new_rows(w), cache, batch.metadata(), TOPK)
    assert slots.dtype == torch.int32 and slots.shape == (sum(n for _, n in batch.shapes), TOPK)
    check_selection(batch, q, w, keys, slots, TOPK)


@pytest.mark.parametrize("new", [1, 4])
def test_equal_scores_go_to_the_earlier_positions(new):
    """A token selects the same keys as a decode and as a verify step's row, whose scores
    span the draft positions too (torch.topk alone breaks ties by the row's width)."""
    batch, q, w, cache, expected = tie_case(new)
    slots = indexer_topk(q, w, cache, batch.metadata(), TOPK)
    assert set(slots[0].tolist()) == expected


def test_write_skips_padding_slots():
    batch = PagedBatch([(0, 3)], 4)
    cache = batch.nan_pool(INDEX_DIM)
    keys = batch.randn(3, INDEX_DIM)
    slots = batch.all_slots(0)
    write_indexer_keys(keys, cache, torch.tensor([slots[0], -1, slots[2]]))
    flat = cache.flatten(0, 1)
    assert torch.equal(flat[slots[0]], keys[0]) and torch.equal(flat[slots[2]], keys[2])
    assert flat[slots[1]].isnan().all()
