"""Sparse MLA's torch reference (atom.kernels.sparse_mla) against naive up-projected math."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.dsa_batches import (
    BATCHES,
    HEADS,
    LATENT,
    NOPE,
    ROPE,
    VALUE,
    PagedBatch,
    naive_sparse_mla,
    sparse_case,
)

from atom.kernels.sparse_mla import sparse_mla

TOPK = 8
SCALE = (NOPE + ROPE) ** -0.5


@pytest.mark.parametrize("name", list(BATCHES))
def test_matches_naive_attention_over_the_selection(name):
    batch = PagedBatch(*BATCHES[name])
    kv_c, k_pe, cache, chosen, topk_slots = sparse_case(batch, TOPK)
    tokens = len(chosen)
    q_nope, q_pe = batch.randn(tokens, HEADS, NOPE), batch.randn(tokens, HEADS, ROPE)
    w_uk, w_uv = batch.randn(HEADS, NOPE, LATENT, std=0.2), batch.randn(HEADS, VALUE, LATENT)
    out = sparse_mla(q_nope, q_pe, cache, topk_slots, SCALE, w_uk, w_uv)
    expected = torch.stack(
        [
            naive_sparse_mla(q_nope[t], q_pe[t], kv_c[i], k_pe[i], w_uk, w_uv, SCALE, picks)
            for t, (i, picks) in enumerate(chosen)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_token_without_selection_gives_zeros():
    batch = PagedBatch([(0, 2)], 4)
    _, _, cache, _, topk_slots = sparse_case(batch, TOPK)
    topk_slots[1] = -1
    q = batch.randn(2, HEADS, NOPE), batch.randn(2, HEADS, ROPE)
    w = batch.randn(HEADS, NOPE, LATENT), batch.randn(HEADS, VALUE, LATENT)
    out = sparse_mla(*q, cache, topk_slots, SCALE, *w)
    assert out[1].eq(0).all() and out[0].isfinite().all()
