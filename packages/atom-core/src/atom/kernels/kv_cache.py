"""Writes new tokens' K/V into the paged cache at their `slot_mapping` slots."""

from __future__ import annotations

import torch

from atom.kernels.policy import dispatch, register


@register("write_kv_cache", "torch")
def write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping) -> None:
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key [T, Hkv, D], value [T, Hkv, Dv] into caches [num_blocks, block_size, Hkv, D|Dv].

    Slot s is block s // block_size, offset s % block_size; slot -1 marks padding.
    """
    dispatch("write_kv_cache", key.device)(key, value, key_cache, value_cache, slot_mapping)
