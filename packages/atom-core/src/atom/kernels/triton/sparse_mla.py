"""Triton sparse MLA (atom.kernels.sparse_mla): one program per (query token, block of
heads) folds the token's selected cache rows into an online softmax.

The K selected slots are read in blocks of BLOCK_N straight from `topk_slots`; each row
is loaded once per head block as keys (L + R channels) and its first L channels serve as
values, as in the dense absorbed decode (atom.kernels.triton.mla). Decode and prefill
tokens run the same program: every token has its own key set. All bounds come from
device tensors, so a captured CUDA graph replays it for any selection.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.policy import capturable, register
from atom.kernels.triton.online_softmax import fold_block

# 16 heads x 32 rows keeps the L = 512 latent tile and its accumulator in registers;
# not yet tuned on an H100.
CONFIG = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}


@triton.jit
def load_slot_rows(cache_ptr, slots, valid, stride_b, stride_s, dims, dim_mask, block_size):
    """The rows [N, dims] of a paged cache at flat slots (page * block_size + row); zeros
    where not valid."""
    page = (slots // block_size).to(tl.int64)
    ptrs = cache_ptr + page[:, None] * stride_b + (slots % block_size)[:, None] * stride_s
    return tl.load(ptrs + dims[None, :], mask=valid[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def _sparse_mla_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, slots_ptr, out_ptr,
    ql_stride_t, ql_stride_h, qp_stride_t, qp_stride_h, c_stride_b, c_stride_s,
    s_stride_t, o_stride_t, o_stride_h, qk_scale, kv_scale, num_heads, block_size,
    latent_dim, rope_dim, topk,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    ldims = tl.arange(0, BLOCK_L)
    rdims = tl.arange(0, BLOCK_R)
    lmask = ldims < latent_dim
    rmask = rdims < rope_dim
    q_latent = tl.load(
        q_latent_ptr + token * ql_stride_t + heads[:, None] * ql_stride_h + ldims[None, :],
        mask=head_valid[:, None] & lmask[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + token * qp_stride_t + heads[:, None] * qp_stride_h + rdims[None, :],
        mask=head_valid[:, None] & rmask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(0, topk, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + token * s_stride_t + n, mask=n < topk, other=-1)
        valid = slots >= 0
        latent = load_slot_rows(
            cache_ptr, slots, valid, c_stride_b, c_stride_s, ldims, lmask, block_size
        ).to(q_latent.dtype)
        rope = load_slot_rows(
            cache_ptr + latent_dim, slots, valid, c_stride_b, c_stride_s, rdims, rmask,
            block_size,
        ).to(q_pe.dtype)  # fmt: skip
        s = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(rope), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = fold_block(s, latent, m_i, l_i, acc, PRECISION)
    acc = acc * kv_scale / tl.where(l_i == 0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + token * o_stride_t + heads[:, None] * o_stride_h + ldims[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & lmask[None, :])


@register("sparse_mla_attention", "triton")
@capturable
def sparse_mla_attention_triton(q_latent, q_pe, kv_cache, topk_slots, scale, out, kv_scale=1.0):
    num_tokens, num_heads, latent_dim = q_latent.shape
    if num_tokens == 0:
        return out
    rope_dim = q_pe.shape[-1]
    kv_scale = kv_scale if is_fp8_kv_cache(kv_cache) else 1.0  # model-dtype caches hold x
    block_h = min(CONFIG["block_h"], max(16, triton.next_power_of_2(num_heads)))
    _sparse_mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q_latent, q_pe, kv_cache, topk_slots, out,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), topk_slots.stride(0),
        out.stride(0), out.stride(1), scale * kv_scale * math.log2(math.e), kv_scale,
        num_heads, kv_cache.shape[1], latent_dim, rope_dim, topk_slots.shape[1],
        BLOCK_H=block_h, BLOCK_N=CONFIG["block_n"],
        BLOCK_L=max(16, triton.next_power_of_2(latent_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"],
    )  # fmt: skip
    return out
