"""The Triton lightning indexer against its torch reference (atom.kernels.indexer).

Small shapes run on CPU under Triton's interpreter (TRITON_INTERPRET=1, fp32);
DeepSeek-V3.2 shapes (64 heads of 128, top 2048 of 4k keys) and bf16 need a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.kernels.dsa_batches import (
    BATCHES,
    PagedBatch,
    check_selection,
    selection_case,
    tie_case,
)

from atom.kernels.indexer import indexer_topk_torch, write_indexer_keys_torch
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import indexer  # noqa: E402

GPU = pytest.mark.gpu


@pytest.mark.parametrize("graph_bound", [False, True], ids=["step width", "graph bound"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_topk_matches_naive_scores(name, graph_bound):
    """graph bound: score rows as wide as a CUDA graph's max_seq_len, far past every
    sequence, whose tail the selection must never read."""
    batch = PagedBatch(*BATCHES[name], device=DEVICE)
    q, w, keys, cache = selection_case(batch)
    metadata = batch.metadata()
    if graph_bound:
        metadata = replace(metadata, max_seq_len=metadata.max_seq_len + 3000)
    out = torch.empty(metadata.num_tokens, 8, dtype=torch.int32, device=DEVICE)
    indexer.indexer_topk_triton(batch.new_rows(q), batch.new_rows(w), cache, metadata, 8, out)
    check_selection(batch, [t.cpu() for t in q], [t.cpu() for t in w], [t.cpu() for t in keys],
                    out.cpu(), 8)  # fmt: skip


@pytest.mark.parametrize("new", [1, 4])
def test_equal_scores_go_to_the_earlier_positions(new):
    batch, q, w, cache, expected = tie_case(new, DEVICE)
    out = torch.empty(new, 8, dtype=torch.int32, device=DEVICE)
    indexer.indexer_topk_triton(q, w, cache, batch.metadata(), 8, out)
    assert set(out[0].tolist()) == expected


def test_write_equals_torch():
    batch = PagedBatch([(0, 5), (3, 6)], 4, device=DEVICE)
    metadata = batch.metadata()
    keys = batch.randn(metadata.num_tokens, 32)
    expected, got = batch.nan_pool(32), batch.nan_pool(32)
    slots = metadata.slot_mapping.clone()
    slots[2] = -1
    write_indexer_keys_torch(keys, expected, slots)
    indexer.write_indexer_keys_triton(keys, got, slots)
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))


@GPU
@pytest.mark.skipif(DEVICE != "cuda", reason="V3.2 shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v32_shape_selects_what_the_reference_selects(dtype):
    batch = PagedBatch([(4000, 1), (3000, 1), (1000, 300)], 64, device=DEVICE, dtype=dtype)
    metadata = batch.metadata()
    tokens = metadata.num_tokens
    q = batch.randn(tokens, 64, 128)
    w = batch.randn(tokens, 64).float() * 64**-0.5 * 128**-0.5
    cache = batch.randn(batch.num_blocks, 64, 128)
    expected = torch.empty(tokens, 2048, dtype=torch.int32, device=DEVICE)
    got = torch.empty_like(expected)
    indexer_topk_torch(q, w, cache, metadata, 2048, expected)
    indexer.indexer_topk_triton(q, w, cache, metadata, 2048, got)
    # Rounding differs between the two, so near-ties at the boundary may swap: nearly all
    # of each token's selection agrees.
    for t in range(tokens):
        a, b = set(expected[t].tolist()), set(got[t].tolist())
        assert len(a & b) >= 0.99 * len(a)
