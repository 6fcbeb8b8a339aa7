"""The torch reference of paged attention reads no page before a sliding window
(tests/kernels/window_pages.py), and gives the same result as with every page."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.window_pages import CASES, HEAD_DIM, make_batch

from atom.kernels.paged_attention import paged_attention_torch


@pytest.mark.parametrize("case", list(CASES))
def test_reference_skips_freed_pages(case):
    query, k_cache, v_cache, real, freed, window = make_batch(case)
    scale = HEAD_DIM**-0.5
    want = paged_attention_torch(
        query, k_cache, v_cache, real, scale, window, None, torch.zeros_like(query)
    )
    got = paged_attention_torch(
        query, k_cache, v_cache, freed, scale, window, None, torch.zeros_like(query)
    )
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    # Without the window every page is read: the NaN page shows.
    causal = paged_attention_torch(
        query, k_cache, v_cache, freed, scale, None, None, torch.zeros_like(query)
    )
    assert torch.isnan(causal).any()
