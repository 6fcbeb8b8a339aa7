"""Triton sparse MLA against its torch reference (atom.kernels.sparse_mla).

Small shapes run on CPU under Triton's interpreter (TRITON_INTERPRET=1, fp32);
DeepSeek-V3.2 shapes (128 heads, L=512, R=64, top 2048) and bf16 need a GPU.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.dsa_batches import BATCHES, HEADS, LATENT, ROPE, PagedBatch, sparse_case

from atom.kernels.sparse_mla import sparse_mla_attention_torch
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import sparse_mla  # noqa: E402

GPU = pytest.mark.gpu
SCALE = 0.1


def run_both(batch, topk_slots, heads, latent, rope):
    tokens = topk_slots.shape[0]
    q_latent, q_pe = batch.randn(tokens, heads, latent), batch.randn(tokens, heads, rope)
    cache = batch.cache
    expected = sparse_mla_attention_torch(
        q_latent, q_pe, cache, topk_slots, SCALE, torch.empty_like(q_latent)
    )
    got = sparse_mla.sparse_mla_attention_triton(
        q_latent, q_pe, cache, topk_slots, SCALE, torch.empty_like(q_latent)
    )
    return got.float(), expected.float()


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("topk", [8, 40])
def test_matches_reference(name, topk):
    batch = PagedBatch(*BATCHES[name], device=DEVICE)
    *_, batch.cache, _, topk_slots = sparse_case(batch, topk)
    topk_slots[-1] = -1  # a token without keys (a host's padding) gives zeros
    got, expected = run_both(batch, topk_slots, HEADS, LATENT, ROPE)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert got[-1].eq(0).all()


@GPU
@pytest.mark.skipif(DEVICE != "cuda", reason="V3.2 shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v32_shape(dtype):
    batch = PagedBatch([(8000, 1)] * 4 + [(0, 300)], 64, device=DEVICE, dtype=dtype)
    *_, batch.cache, _, topk_slots = sparse_case(batch, 2048, latent=512, rope=64)
    got, expected = run_both(batch, topk_slots, 128, 512, 64)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
