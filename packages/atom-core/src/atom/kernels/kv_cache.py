"""Writes new tokens' K/V into the paged cache at their `slot_mapping` slots.

An fp8 cache (float8_e4m3fn) holds x / scale with one scale per tensor (k_scale, v_scale
per layer), saturated to the format's ±448; readers multiply by the scale again. Caches in
the model dtype hold x itself and ignore the scales.
"""

from __future__ import annotations

import torch

from atom.kernels.policy import dispatch, register

FP8_KV_CACHE_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV_CACHE_DTYPE).max  # 448


def is_fp8_kv_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_CACHE_DTYPE


def fp8_kv_cache_unsupported(device: torch.device) -> str | None:
    """Why `device` cannot run an fp8 KV cache, or None where it can (the CPU's torch
    reference, NVIDIA GPUs of compute capability 8.9 or newer)."""
    if device.type != "cuda":
        return None
    if torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9):
        return None
    return (
        "kv_cache_dtype='fp8' (float8_e4m3fn) needs an NVIDIA GPU of compute capability "
        f"8.9 or newer (or the CPU); {torch.cuda.get_device_name(device)} has no such "
        "kernels here"
    )


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: x / scale saturated to ±448 for fp8."""
    if cache_dtype != FP8_KV_CACHE_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(cache_dtype)


def dequantize_kv(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows back in fp32 (x itself for a model-dtype cache)."""
    if rows.dtype != FP8_KV_CACHE_DTYPE:
        return rows.float()
    return rows.float() * scale


@register("write_kv_cache", "torch")
def write_kv_cache_torch(
    key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
) -> None:
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = quantize_kv(key[valid], k_scale, key_cache.dtype)
    value_cache[blocks, offsets] = quantize_kv(value[valid], v_scale, value_cache.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key [T, Hkv, D], value [T, Hkv, Dv] into caches [num_blocks, block_size, Hkv, D|Dv].

    Slot s is block s // block_size, offset s % block_size; slot -1 marks padding.
    k_scale / v_scale: an fp8 cache's per-tensor scales (see the module docstring).
    """
    dispatch("write_kv_cache", key.device)(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
    )
