"""Scatter new tokens' K/V rows into their cache slots: one program per token."""

from __future__ import annotations

import triton
import triton.language as tl

from atom.kernels.kv_cache import FP8_KV_MAX as _FP8_KV_MAX
from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.policy import register

FP8_KV_MAX = tl.constexpr(_FP8_KV_MAX)


@triton.jit
def quantize_kv(x, scale, cache_ptr, FP8: tl.constexpr):
    """x as the cache stores it (atom.kernels.kv_cache): x / scale saturated for fp8."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -FP8_KV_MAX, FP8_KV_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
    block_size, num_heads, head_dim, v_head_dim, k_scale, v_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block, offset = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    k_dst = key_cache_ptr + block * kc_stride_b + offset * kc_stride_s + heads * kc_stride_h + dims
    tl.store(k_dst, quantize_kv(k, k_scale, key_cache_ptr, FP8), mask=mask)
    vdims = tl.arange(0, BLOCK_DV)[None, :]
    vmask = (heads < num_heads) & (vdims < v_head_dim)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + vdims, mask=vmask)
    v_dst = (
        value_cache_ptr + block * vc_stride_b + offset * vc_stride_s + heads * vc_stride_h + vdims
    )
    tl.store(v_dst, quantize_kv(v, v_scale, value_cache_ptr, FP8), mask=vmask)


@register("write_kv_cache", "triton")
def write_kv_cache_triton(
    key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[1], num_heads, head_dim, value.shape[-1], k_scale, v_scale,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(value.shape[-1]), FP8=is_fp8_kv_cache(key_cache),
    )  # fmt: skip
