"""KV write against a per-token loop over slots."""

from __future__ import annotations

import pytest
import torch

from atom.kernels import FP8_DTYPE, write_kv_cache

SENTINEL = 7.0


def naive_write(key, value, key_cache, value_cache, slots):
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slots):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t].to(key_cache.dtype)
            value_cache[slot // block_size, slot % block_size] = value[t].to(value_cache.dtype)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_write_matches_loop_and_skips_padding(block_size, cache_dtype):
    num_blocks, kv_heads, head_dim, v_dim = 8, 2, 64, 48
    num_slots = num_blocks * block_size
    tokens = min(num_slots, 12)
    slots = torch.randperm(num_slots)[:tokens]
    slots[torch.randperm(tokens)[:3]] = -1  # padding tokens
    key, value = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, v_dim)

    def caches():
        k = torch.full((num_blocks, block_size, kv_heads, head_dim), SENTINEL).to(cache_dtype)
        v = torch.full((num_blocks, block_size, kv_heads, v_dim), SENTINEL).to(cache_dtype)
        return k, v

    got_k, got_v = caches()
    want_k, want_v = caches()
    write_kv_cache(key, value, got_k, got_v, slots)
    naive_write(key, value, want_k, want_v, slots.tolist())
    # Bitwise: both sides cast the same values to the cache dtype; untouched slots keep
    # the sentinel, so padding and slots nobody wrote stay as they were.
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    written = int((got_k.float() != SENTINEL).flatten(2).any(-1).sum())
    assert written == int((slots >= 0).sum())


def test_all_padding_writes_nothing():
    key_cache, value_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    write_kv_cache(
        torch.randn(3, 1, 8), torch.randn(3, 1, 8), key_cache, value_cache, torch.full((3,), -1)
    )
    assert not key_cache.any() and not value_cache.any()
