"""A step of the same few tokens per sequence (a speculative verify step, a drafter's
catch-up) through the Triton decode kernel, as decodes of that many causal queries each,
against the torch reference of paged attention.

The dense key/value handed to the dispatch are NaN: the decode path must read every key
from the pages, because a CUDA-graph replay puts padding rows in front of a sequence's own
(`engine.step_arrays.pad_rows_in_front`), whose dense K/V are not the cache's. On CPU it
runs fp32 under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise); the `gpu`
cases run bf16.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_triton_prefill_attention import make_batch, make_sinks

from atom.kernels.few_queries import few_queries_as_decodes
from atom.kernels.paged_attention import paged_attention_torch
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import paged_attention  # noqa: E402


def check(contexts, queries, page_size, heads, kv_heads, dtype=torch.float32, window=None,
          soft_cap=None, sinks=False, head_dim=64):  # fmt: skip
    query, k_cache, v_cache, md, key, value = make_batch(
        [], [(c, queries) for c in contexts], page_size, heads, kv_heads, head_dim, head_dim,
        dtype,
    )  # fmt: skip
    assert few_queries_as_decodes(md).num_decode_tokens == len(contexts) * queries
    sink_logits = make_sinks(heads, dtype) if sinks else None
    scale = head_dim**-0.5
    want = paged_attention_torch(
        query, k_cache, v_cache, md, scale, window, soft_cap, torch.zeros_like(query),
        sinks=sink_logits,
    )  # fmt: skip
    got = torch.zeros_like(query)
    nan = torch.full_like(key, float("nan"))
    paged_attention.paged_attention_triton(
        query, k_cache, v_cache, md, scale, window, soft_cap, got, nan, nan.clone(),
        sinks=sink_logits,
    )  # fmt: skip
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("queries", [2, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_few_queries_per_sequence_match_the_reference(queries, heads, kv_heads, page_size):
    check([0, 5, 37, 70], queries, page_size, heads, kv_heads)


@pytest.mark.parametrize(("window", "soft_cap", "sinks"), [(6, None, False), (None, 5.0, True)])
def test_window_soft_cap_and_sinks(window, soft_cap, sinks):
    check([3, 29, 64], 4, 16, 8, 2, window=window, soft_cap=soft_cap, sinks=sinks)


def test_one_split_writes_the_output_itself(monkeypatch):
    monkeypatch.setitem(paged_attention.DECODE_CONFIG, "num_splits", 1)
    check([9, 40], 3, 16, 4, 2)


def test_many_queries_widen_the_tile():
    """8 queries x 8 heads a KV head: a 64-row tile (twice the warps)."""
    check([12, 50], 8, 16, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("queries", [2, 4, 8])
def test_bf16_verify_steps_on_gpu(queries):
    check([100, 517, 2048, 31] * 8, queries, 16, 32, 8, torch.bfloat16, head_dim=128)


@pytest.mark.gpu
def test_bf16_gpt_oss_shape_on_gpu():
    check([300, 1500] * 4, 4, 16, 64, 8, torch.bfloat16, window=128, sinks=True)
