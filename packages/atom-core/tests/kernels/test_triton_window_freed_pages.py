"""The Triton decode and prefill kernels read no page before a sliding window
(tests/kernels/window_pages.py): with the freed pages pointing at NaN they equal the torch
reference over the real pages, and their own output over the real pages, bit for bit.
On CPU under Triton's interpreter (TRITON_INTERPRET=1), small tiles so that a key block
straddles the window's edge."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.window_pages import CASES, HEAD_DIM, make_batch

from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.paged_attention import paged_attention_torch  # noqa: E402
from atom.kernels.triton import paged_attention, prefill_attention  # noqa: E402

SMALL = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False}


def attend(query, k_cache, v_cache, metadata, window, dense):
    out = torch.zeros_like(query)
    scale = HEAD_DIM**-0.5
    kv = (None, None)
    if dense:  # the new tokens' K/V as the host wrote them, read from the real pages
        rows = metadata.slot_mapping
        kv = (k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows])
    paged_attention.decode_attention(query, k_cache, v_cache, metadata, scale, window, None, out)
    prefill_attention.prefill_attention(
        query, k_cache, v_cache, metadata, scale, window, None, out, *kv, config=SMALL
    )
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["pages only", "dense new K/V"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_skips_freed_pages(case, dense):
    query, k_cache, v_cache, real, freed, window = make_batch(case, DEVICE)
    got = attend(query, k_cache, v_cache, freed, window, dense)
    assert torch.isfinite(got).all()
    assert torch.equal(got, attend(query, k_cache, v_cache, real, window, dense))
    want = paged_attention_torch(
        query, k_cache, v_cache, real, HEAD_DIM**-0.5, window, None, torch.zeros_like(query)
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
