"""q/k RMSNorm + rotary + KV write in one launch: one program per (token, tile of heads).

A token's tiles are its q-head tiles followed by its KV-head tiles. A q tile normalises,
rotates and stores into the new q; a KV tile does the same for k but stores into the
token's cache slot and back into k, and copies v next to it. Each element is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.policy import register
from atom.kernels.triton.kv_cache import quantize_kv

# Channels per program: enough work per program to hide latency, few enough registers.
TILE_ELEMENTS = 2048


@triton.jit
def _rms_scale(x, inv_rms, weight_ptr, mask):
    # The reference's rounding: normalise in fp32, round to x's dtype, then the weight.
    weight = tl.load(weight_ptr, mask=mask, other=0.0)
    return weight * (x.to(tl.float32) * inv_rms).to(x.dtype)


@triton.jit
def _norm_rope_heads(
    src, heads_ok, first, second, pair_ok, rest, rest_ok, cos, sin,
    weight_ptr, head_dim, eps,
    NORM: tl.constexpr, HAS_REST: tl.constexpr,
):  # fmt: skip
    """src: [BLOCK_H, 1] pointers to each head's channel 0; returns the rotated pairs
    (first, second) in fp32 and the unrotated rest (without HAS_REST: a stand-in that
    _store_heads ignores), normalised."""
    pair_mask = heads_ok & pair_ok
    rest_mask = heads_ok & rest_ok
    x1 = tl.load(src + first, mask=pair_mask, other=0.0)
    x2 = tl.load(src + second, mask=pair_mask, other=0.0)
    if HAS_REST:
        xr = tl.load(src + rest, mask=rest_mask, other=0.0)
    if NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        squares = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        if HAS_REST:
            c = xr.to(tl.float32)
            squares += tl.sum(c * c, axis=1)
        inv_rms = tl.rsqrt(squares / head_dim + eps)[:, None]
        x1 = _rms_scale(x1, inv_rms, weight_ptr + first, pair_ok)
        x2 = _rms_scale(x2, inv_rms, weight_ptr + second, pair_ok)
        if HAS_REST:
            xr = _rms_scale(xr, inv_rms, weight_ptr + rest, rest_ok)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # One return: the compiler unifies the types of every return, constexpr branches too.
    if not HAS_REST:
        xr = a
    return a * cos - b * sin, b * cos + a * sin, xr


@triton.jit
def _store_heads(dst, heads_ok, first, second, pair_ok, rest, rest_ok, x1, x2, xr,
                 HAS_REST: tl.constexpr, scale, FP8: tl.constexpr):  # fmt: skip
    """Stores into dst's dtype; FP8: quantized with `scale`, as an fp8 KV cache holds it."""
    tl.store(dst + first, quantize_kv(x1, scale, dst, FP8), mask=heads_ok & pair_ok)
    tl.store(dst + second, quantize_kv(x2, scale, dst, FP8), mask=heads_ok & pair_ok)
    if HAS_REST:
        tl.store(dst + rest, quantize_kv(xr, scale, dst, FP8), mask=heads_ok & rest_ok)


# The token count changes every step: specialising on it (==1, %16) would recompile
# the kernel mid-serving.
@triton.jit(do_not_specialize=["num_slots"])
def _fused_qkv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr,
    positions_ptr, cos_sin_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    out_stride_t, out_stride_h,
    kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s, vc_stride_h,
    cos_sin_stride, num_q_heads, num_kv_heads, head_dim, v_head_dim, rotary_dim,
    block_size, num_slots, num_q_tiles, eps, k_scale, v_scale,
    NORM: tl.constexpr, IS_NEOX: tl.constexpr, HAS_REST: tl.constexpr, FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    half = rotary_dim // 2
    i = tl.arange(0, BLOCK_HALF)[None, :]
    pair_ok = i < half
    if IS_NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    rest = rotary_dim + tl.arange(0, BLOCK_REST)[None, :]
    rest_ok = rest < head_dim
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + i, mask=pair_ok).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + half + i, mask=pair_ok).to(tl.float32)
    h = tl.arange(0, BLOCK_H)[:, None]
    if tile < num_q_tiles:
        heads = tile * BLOCK_H + h
        heads_ok = heads < num_q_heads
        x1, x2, xr = _norm_rope_heads(
            q_ptr + token * q_stride_t + heads * q_stride_h,
            heads_ok, first, second, pair_ok, rest, rest_ok, cos, sin,
            q_norm_ptr, head_dim, eps, NORM=NORM, HAS_REST=HAS_REST,
        )  # fmt: skip
        _store_heads(q_out_ptr + token * out_stride_t + heads * out_stride_h, heads_ok,
                     first, second, pair_ok, rest, rest_ok, x1, x2, xr, HAS_REST, 1.0, False)  # fmt: skip
    else:
        heads = (tile - num_q_tiles) * BLOCK_H + h
        # Tokens past the slot mapping are a host's padding, like slot -1.
        slot = tl.load(slot_ptr + token, mask=token < num_slots, other=-1)
        k_heads = k_ptr + token * k_stride_t + heads * k_stride_h
        kv_heads_ok = heads < num_kv_heads
        x1, x2, xr = _norm_rope_heads(
            k_heads, kv_heads_ok, first, second, pair_ok, rest, rest_ok, cos, sin,
            k_norm_ptr, head_dim, eps, NORM=NORM, HAS_REST=HAS_REST,
        )  # fmt: skip
        # Every row back into k (the step's new keys for attention), slots only into the cache.
        _store_heads(k_heads, kv_heads_ok, first, second, pair_ok, rest, rest_ok,
                     x1, x2, xr, HAS_REST, 1.0, False)  # fmt: skip
        heads_ok = kv_heads_ok & (slot >= 0)
        block, offset = slot // block_size, slot % block_size
        _store_heads(
            key_cache_ptr + block * kc_stride_b + offset * kc_stride_s + heads * kc_stride_h,
            heads_ok, first, second, pair_ok, rest, rest_ok, x1, x2, xr, HAS_REST, k_scale, FP8,
        )  # fmt: skip
        vdims = tl.arange(0, BLOCK_DV)[None, :]
        vmask = heads_ok & (vdims < v_head_dim)
        v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + vdims, mask=vmask)
        v_dst = value_cache_ptr + block * vc_stride_b + offset * vc_stride_s + heads * vc_stride_h
        tl.store(v_dst + vdims, quantize_kv(v, v_scale, value_cache_ptr, FP8), mask=vmask)


@register("fused_qkv_rope_write_kv", "triton")
def fused_qkv_rope_write_kv_triton(
    q, k, v, positions, cos_sin_cache, rotary_dim, is_neox,
    key_cache, value_cache, slot_mapping, q_norm_weight, k_norm_weight, eps,
    k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k.shape[1], v.shape[2]
    norm = q_norm_weight is not None
    # As the reference: a norm weight of a wider dtype widens q.
    out_dtype = torch.promote_types(q.dtype, q_norm_weight.dtype) if norm else q.dtype
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=out_dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    for t in (q, k, v, key_cache, value_cache):
        assert t.stride(-1) == 1, "channels must be contiguous"
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, TILE_ELEMENTS // block_d))
    num_q_tiles = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_tiles + triton.cdiv(num_kv_heads, block_h))
    rest = head_dim - rotary_dim
    _fused_qkv_kernel[grid](
        q, k, v, q_out, key_cache, value_cache,
        positions, cos_sin_cache, slot_mapping,
        q_norm_weight if norm else q, k_norm_weight if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        cos_sin_cache.stride(0), num_q_heads, num_kv_heads, head_dim, v_head_dim, rotary_dim,
        key_cache.shape[1], slot_mapping.shape[0], num_q_tiles, eps, k_scale, v_scale,
        NORM=norm, IS_NEOX=is_neox, HAS_REST=rest > 0, FP8=is_fp8_kv_cache(key_cache),
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        num_warps=max(1, min(4, block_h * block_d // 256)),
    )  # fmt: skip
    return q_out
