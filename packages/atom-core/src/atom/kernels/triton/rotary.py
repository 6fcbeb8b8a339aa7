"""Rotary embedding: one program per (token, head) of q and k, rotating in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import register


@triton.jit
def _rotary_kernel(
    positions_ptr, x_ptr, out_ptr, cache_ptr,
    x_stride_t, x_stride_h, out_stride_t, out_stride_h, cache_stride,
    head_dim, rotary_dim,
    IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    half = rotary_dim // 2
    src = x_ptr + token * x_stride_t + head * x_stride_h
    dst = out_ptr + token * out_stride_t + head * out_stride_h
    # Channels past rotary_dim pass through unchanged.
    dims = tl.arange(0, BLOCK_D)
    rest = (dims >= rotary_dim) & (dims < head_dim)
    tl.store(dst + dims, tl.load(src + dims, mask=rest), mask=rest)

    pos = tl.load(positions_ptr + token)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < half
    cos = tl.load(cache_ptr + pos * cache_stride + i, mask=mask).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + half + i, mask=mask).to(tl.float32)
    if IS_NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src + first, mask=mask).to(tl.float32)
    x2 = tl.load(src + second, mask=mask).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(dst + first, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


def _rotate(positions, x, cos_sin_cache, rotary_dim, is_neox):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _rotary_kernel[(x.shape[0], x.shape[1])](
        positions, x, out, cos_sin_cache,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        x.shape[2], rotary_dim,
        IS_NEOX=is_neox,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_D=triton.next_power_of_2(x.shape[2]),
    )  # fmt: skip
    return out


@register("apply_rotary_emb", "triton")
def apply_rotary_emb_triton(positions, query, key, cos_sin_cache, rotary_dim, is_neox):
    return (
        _rotate(positions, query, cos_sin_cache, rotary_dim, is_neox),
        _rotate(positions, key, cos_sin_cache, rotary_dim, is_neox),
    )
