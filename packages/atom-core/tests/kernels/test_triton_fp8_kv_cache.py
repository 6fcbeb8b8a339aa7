"""Triton's KV write, fused q/k rope + KV write, decode and prefill with an fp8 KV cache
against the torch references (the references are checked in test_fp8_kv_cache.py).

Runs on a CUDA device (compute capability 8.9+), or fp32 under Triton's interpreter on
the CPU (TRITON_INTERPRET=1); skipped otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.kernels.test_fp8_kv_cache import (
    HEAD_DIM,
    K_SCALE,
    KV_HEADS,
    MIXED_BATCH,
    V_SCALE,
    make_fp8_batch,
)

from atom.kernels.fused_qkv import fused_qkv_rope_write_kv_torch
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE, write_kv_cache_torch
from atom.kernels.paged_attention import paged_attention_torch
from atom.kernels.rotary import compute_cos_sin_cache
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import paged_attention as triton_paged  # noqa: E402
from atom.kernels.triton.fused_qkv import fused_qkv_rope_write_kv_triton  # noqa: E402
from atom.kernels.triton.kv_cache import write_kv_cache_triton  # noqa: E402
from atom.kernels.triton.prefill_attention import prefill_attention  # noqa: E402

# Division by the scale may round differently on the GPU: one e4m3 step (2^-3 relative,
# 2^-9 absolute near zero) at most, in scaled units.
FP8_STEP = {"rtol": 0.125, "atol": 2**-9}
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
SMALL = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False}


def assert_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float(), want.float()
    if DEVICE == "cpu":
        # Triton 3.9's interpreter rounds fp32 to e4m3 with a carry bug: a value that rounds
        # up to a power of two comes out as half of it. The GPU's conversion has none.
        carried = (got * 2 == want) & (torch.frexp(want).mantissa.abs() == 0.5)
        got = torch.where(carried, want, got)
    torch.testing.assert_close(got, want, **FP8_STEP)
    assert (got == want).float().mean() > 0.99


def fp8_caches(num_slots, block_size, heads, dim):
    shape = (num_slots // block_size, block_size, heads, dim)
    return (
        torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE, device=DEVICE),
        torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE, device=DEVICE),
    )


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_cache(block_size):
    gen = torch.Generator().manual_seed(block_size)
    key = (torch.randn(20, KV_HEADS, HEAD_DIM, generator=gen) * 10).to(DEVICE)
    value = torch.randn(20, KV_HEADS, 48, generator=gen).to(DEVICE)
    key[0, 0, :2] = torch.tensor([1e4, -1e4])  # saturates
    slots = torch.randperm(64, generator=gen)[:20]
    slots[[2, 11]] = -1
    slots = slots.to(DEVICE)
    got_k, _ = fp8_caches(64, block_size, KV_HEADS, HEAD_DIM)
    want_k, _ = fp8_caches(64, block_size, KV_HEADS, HEAD_DIM)
    got_v, want_v = fp8_caches(64, block_size, KV_HEADS, 48)
    write_kv_cache_triton(key, value, got_k, got_v, slots, K_SCALE, V_SCALE)
    write_kv_cache_torch(key, value, want_k, want_v, slots, K_SCALE, V_SCALE)
    assert_same_cache(got_k, want_k)
    assert_same_cache(got_v, want_v)


@pytest.mark.parametrize("norm", [True, False])
def test_fused_qkv_rope_write_kv(norm):
    gen = torch.Generator().manual_seed(3)
    tokens, heads = 13, 8
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(DEVICE)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    cos_sin, _ = compute_cos_sin_cache(HEAD_DIM, 512, 10000.0, None)
    slots = torch.randperm(64, generator=gen)[: tokens - 1]
    slots[[3, 8]] = -1
    slots = slots.to(DEVICE)
    weights = [None, None]
    if norm:
        weights = [torch.rand(HEAD_DIM, generator=gen).to(DEVICE) + 0.5 for _ in range(2)]
    args = (positions, cos_sin.to(DEVICE), HEAD_DIM, True)
    got_caches = fp8_caches(64, 16, KV_HEADS, HEAD_DIM)
    want_caches = fp8_caches(64, 16, KV_HEADS, HEAD_DIM)
    want_k = k.clone()
    got_q = fused_qkv_rope_write_kv_triton(
        q, k, v, *args, *got_caches, slots, *weights, 1e-6, K_SCALE, V_SCALE
    )
    want_q = fused_qkv_rope_write_kv_torch(
        q, want_k, v, *args, *want_caches, slots, *weights, 1e-6, K_SCALE, V_SCALE
    )
    torch.testing.assert_close(got_q, want_q, **FP32_TOL)
    torch.testing.assert_close(k, want_k, **FP32_TOL)  # unquantized, rotated keys
    for got_cache, want_cache in zip(got_caches, want_caches):
        assert_same_cache(got_cache, want_cache)


def reference(query, key_cache, value_cache, metadata, scale, window, sinks):
    out = torch.empty_like(query)
    return paged_attention_torch(
        query, key_cache, value_cache, metadata, scale, window, None, out,
        sinks=sinks, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip


VARIANTS = {"causal": (None, False), "window": (8, False), "sinks": (None, True)}


@pytest.mark.parametrize("splits", [1, None], ids=["single split", "split-K"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_mixed_batch(group, variant, splits, monkeypatch):
    """Decodes (split-K or not) and prefills through the Triton dispatch; the unquantized
    new K/V passed along must not be read (the cache holds them quantized)."""
    monkeypatch.setitem(triton_paged.DECODE_CONFIG, "num_splits", splits)
    window, with_sinks = VARIANTS[variant]
    query, key_cache, value_cache, metadata, keys, values = make_fp8_batch(
        MIXED_BATCH, group, 16, seed=group, device=DEVICE
    )
    sinks = torch.randn(query.shape[1]).to(DEVICE) if with_sinks else None
    new_keys = torch.cat([k[c:] for (c, _), k in zip(MIXED_BATCH, keys)]).to(DEVICE)
    new_values = torch.cat([v[c:] for (c, _), v in zip(MIXED_BATCH, values)]).to(DEVICE)
    scale = 1 / math.sqrt(HEAD_DIM)
    got = triton_paged.paged_attention_triton(
        query, key_cache, value_cache, metadata, scale, window, None, torch.empty_like(query),
        new_keys, new_values, sinks, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    want = reference(query, key_cache, value_cache, metadata, scale, window, sinks)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_tiles_over_pages(block_size):
    """Small tiles: sequences span several tiles and key blocks, pages of each nesting."""
    query, key_cache, value_cache, metadata, _, _ = make_fp8_batch(
        MIXED_BATCH, 2, block_size, seed=block_size, device=DEVICE
    )
    scale = 1 / math.sqrt(HEAD_DIM)
    got = torch.zeros_like(query)
    prefill_attention(
        query, key_cache, value_cache, metadata, scale, None, None, got,
        config=SMALL, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    want = reference(query, key_cache, value_cache, metadata, scale, None, None)
    prefill_rows = slice(metadata.num_decodes, None)
    torch.testing.assert_close(got[prefill_rows], want[prefill_rows], **FP32_TOL)
