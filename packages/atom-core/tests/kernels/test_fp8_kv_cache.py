"""The fp8 KV cache (float8_e4m3fn, per-tensor k_scale / v_scale): the KV write quantizes,
paged attention reads the cache times its scale.

The torch reference with an fp8 cache must equal dense attention over the dequantized K/V
(to fp32 tolerance) for decodes and prefills with and without a cached prefix, GQA,
sliding windows and sinks. Triton's versions are checked in test_triton_fp8_kv_cache.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from atom.forward_context import AttentionMetadata
from atom.kernels import AttentionScoring, PagedKVCache, paged_attention, write_kv_cache
from atom.kernels.fused_qkv import fused_qkv_rope_write_kv_torch
from atom.kernels.kv_cache import FP8_KV_CACHE_DTYPE, FP8_KV_MAX
from atom.kernels.rotary import apply_rotary_emb_torch, compute_cos_sin_cache

KV_HEADS, HEAD_DIM = 2, 32
K_SCALE, V_SCALE = 0.05, 0.37
# (cached context, new tokens): decodes first, then a fresh, a prefixed and a long prefill.
MIXED_BATCH = [(37, 1), (0, 1), (70, 1), (0, 13), (21, 6), (40, 17)]
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache gives back for x, from the definition: x / scale, saturated, e4m3."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


def make_fp8_batch(seqs, group, block_size, seed=0, device="cpu"):
    """Every position's K/V written through write_kv_cache into fp8 pages scattered in a
    pool; returns query, caches, metadata and each sequence's unpaged, unquantized K/V."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [context + new for context, new in seqs]
    pages_needed = [-(-length // block_size) for length in lengths]
    pool = list(range(sum(pages_needed) + 4))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in pages_needed]
    num_pages = len(pool) + sum(pages_needed)
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * 2 for n in lengths]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in lengths]
    shape = (num_pages, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE, device=device)
    value_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE, device=device)
    slots = [
        [table[p // block_size] * block_size + p % block_size for p in range(n)]
        for table, n in zip(tables, lengths)
    ]
    write_kv_cache(
        torch.cat(keys).to(device),
        torch.cat(values).to(device),
        key_cache,
        value_cache,
        torch.tensor(sum(slots, []), device=device),
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    new_slots = [s for (context, _), seq_slots in zip(seqs, slots) for s in seq_slots[context:]]
    metadata = AttentionMetadata.build(
        [n for _, n in seqs], lengths, tables, new_slots, device=device
    )
    query = torch.randn(sum(n for _, n in seqs), KV_HEADS * group, HEAD_DIM, generator=gen)
    return query.to(device), key_cache, value_cache, metadata, keys, values


def dense_reference(query, keys, values, seqs, scale, window=None, sinks=None):
    """float64 attention of each new token over its sequence's fp8 round-tripped K/V."""
    out, row = [], 0
    for (context, new), k, v in zip(seqs, keys, values):
        group = query.shape[1] // k.shape[1]
        k = fp8_round_trip(k, K_SCALE).repeat_interleave(group, dim=1)
        v = fp8_round_trip(v, V_SCALE).repeat_interleave(group, dim=1)
        for j in range(new):
            position = context + j
            first = 0 if window is None else max(0, position - window + 1)
            q = query[row + j].double()
            scores = torch.einsum("hd,khd->hk", q, k[first : position + 1]) * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], -1)
            probs = scores.softmax(-1)[:, : position + 1 - first]
            out.append(torch.einsum("hk,khd->hd", probs, v[first : position + 1]))
        row += new
    return torch.stack(out).float()


@pytest.mark.parametrize("block_size", [1, 16])
def test_write_quantizes_with_scale_and_saturates(block_size):
    key = torch.randn(6, KV_HEADS, HEAD_DIM)
    value = torch.randn(6, KV_HEADS, HEAD_DIM)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 448 * K_SCALE * 1.5, -(2**-12)])
    shape = (4, block_size * 2, KV_HEADS, HEAD_DIM)
    key_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE)
    value_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE)
    slots = torch.tensor([5, -1, 0, 3, 7, 2])
    write_kv_cache(key, value, key_cache, value_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    valid = slots >= 0
    rows_k = key_cache.flatten(0, 1)[slots[valid]]
    rows_v = value_cache.flatten(0, 1)[slots[valid]]
    torch.testing.assert_close(rows_k.double() * K_SCALE, fp8_round_trip(key[valid], K_SCALE))
    torch.testing.assert_close(rows_v.double() * V_SCALE, fp8_round_trip(value[valid], V_SCALE))
    saturated = key_cache.flatten(0, 1)[5, 0, :3].float().tolist()
    assert saturated == [FP8_KV_MAX, -FP8_KV_MAX, FP8_KV_MAX]
    assert not key_cache.float().isnan().any()


VARIANTS = {"causal": (None, False), "window": (8, False), "sinks": (None, True), "both": (8, True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense_attention_over_dequantized_kv(group, block_size, variant):
    window, with_sinks = VARIANTS[variant]
    query, key_cache, value_cache, metadata, keys, values = make_fp8_batch(
        MIXED_BATCH, group, block_size, seed=group * 7 + block_size
    )
    sinks = torch.randn(query.shape[1]) if with_sinks else None
    scale = 1 / math.sqrt(HEAD_DIM)
    cache = PagedKVCache(key_cache, value_cache, K_SCALE, V_SCALE)
    got = paged_attention(
        query, cache, metadata, AttentionScoring(scale, sliding_window=window, sinks=sinks)
    )
    want = dense_reference(query, keys, values, MIXED_BATCH, scale, window, sinks)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_new_keys_come_from_the_quantized_pages():
    """The unquantized new K/V a host passes along must not stand in for the cache."""
    query, key_cache, value_cache, metadata, keys, values = make_fp8_batch(MIXED_BATCH, 2, 16)
    new_keys = torch.cat([k[c:] for (c, _), k in zip(MIXED_BATCH, keys)])
    new_values = torch.cat([v[c:] for (c, _), v in zip(MIXED_BATCH, values)])
    cache = PagedKVCache(key_cache, value_cache, K_SCALE, V_SCALE)
    scoring = AttentionScoring(1 / math.sqrt(HEAD_DIM))
    without = paged_attention(query, cache, metadata, scoring)
    given = paged_attention(query, cache, metadata, scoring, new_kv=(new_keys, new_values))
    assert torch.equal(without, given)


def test_model_dtype_cache_ignores_the_scales():
    query, _, _, metadata, keys, values = make_fp8_batch(MIXED_BATCH, 2, 16)
    block_size, pages = 16, metadata.block_table.max().item() + 1
    key_cache = torch.zeros(pages, block_size, KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    slots = [
        int(metadata.block_table[i, p // block_size]) * block_size + p % block_size
        for i, k in enumerate(keys)
        for p in range(k.shape[0])
    ]
    args = (torch.cat(keys), torch.cat(values), key_cache, value_cache, torch.tensor(slots))
    write_kv_cache(*args, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(key_cache.flatten(0, 1)[slots], torch.cat(keys))
    scoring = AttentionScoring(1 / math.sqrt(HEAD_DIM))
    plain = paged_attention(query, PagedKVCache(key_cache, value_cache), metadata, scoring)
    scaled = paged_attention(
        query, PagedKVCache(key_cache, value_cache, K_SCALE, V_SCALE), metadata, scoring
    )
    assert torch.equal(plain, scaled)


def test_fused_reference_writes_quantized_keys_and_keeps_k_unquantized():
    gen = torch.Generator().manual_seed(5)
    tokens, heads = 7, 4
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    positions = torch.arange(3, 3 + tokens)
    cos_sin, _ = compute_cos_sin_cache(HEAD_DIM, 64, 10000.0, None)
    shape = (4, 4, KV_HEADS, HEAD_DIM)
    key_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE)
    value_cache = torch.zeros(shape, dtype=FP8_KV_CACHE_DTYPE)
    slots = torch.tensor([9, 0, -1, 4, 15, 2, 7])
    _, rotated_k = apply_rotary_emb_torch(positions, q, k, cos_sin, HEAD_DIM, True)
    raw_v = v.clone()
    fused_qkv_rope_write_kv_torch(
        q, k, v, positions, cos_sin, HEAD_DIM, True, key_cache, value_cache, slots,
        None, None, 0.0, K_SCALE, V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(k, rotated_k)  # k itself stays unquantized
    valid = slots >= 0
    got_k = key_cache.flatten(0, 1)[slots[valid]].double() * K_SCALE
    got_v = value_cache.flatten(0, 1)[slots[valid]].double() * V_SCALE
    torch.testing.assert_close(got_k, fp8_round_trip(rotated_k[valid], K_SCALE))
    torch.testing.assert_close(got_v, fp8_round_trip(raw_v[valid], V_SCALE))
