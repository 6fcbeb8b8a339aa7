"""FP8 (e4m3): per-token-group activation quantization and the scaled GEMM.

Scales of every layout are read through strides, a stride of 0 broadcasting: per tensor,
per token / per channel, and (block mode) per token group of the activation and 2D blocks
of the weight. Block scales vary along K, so they are applied after each K step; the others
once in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.fp8 import FP8_MAX, fp8_scaled_mm_torch
from atom.kernels.policy import register
from atom.kernels.triton.tiles import tile_ranges

_MIN_SCALE = 1e-12  # as the reference: an all-zero group still gets a finite scale


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, num_cols, num_groups, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_P2: tl.constexpr, FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    member = tl.arange(0, GROUP_P2)
    cols = groups[:, None] * GROUP + member[None, :]
    mask = (member < GROUP)[None, :] & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE) / FP8_MAX
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


@register("quantize_fp8_per_token_group", "triton")
def quantize_fp8_per_token_group_triton(x: torch.Tensor, group_size: int):
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    group_p2 = triton.next_power_of_2(group_size)
    block_g = max(1, min(triton.next_power_of_2(num_groups), 2048 // group_p2))
    if m:
        _quantize_groups_kernel[(m, triton.cdiv(num_groups, block_g))](
            x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=group_size, BLOCK_G=block_g, GROUP_P2=group_p2, FP8_MAX=FP8_MAX,
            MIN_SCALE=_MIN_SCALE,
        )  # fmt: skip
    return q, scale


@triton.jit
def _fp8_scaled_mm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, SCALES_ALONG_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    rows, cols, row_ok, col_ok = tile_ranges(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    b_scale_ptrs = b_scale_ptr + (cols // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALES_ALONG_K:  # BLOCK_K divides GROUP_K: one scale per row / column and step
            group = k0 // GROUP_K
            a_scale = tl.load(a_scale_ptrs + group * stride_ask, mask=row_ok, other=0.0)
            b_scale = tl.load(b_scale_ptrs + group * stride_bsk, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not SCALES_ALONG_K:
        a_scale = tl.load(a_scale_ptrs, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptrs, mask=col_ok, other=0.0)
        acc *= a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _scale_strides(scale: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A [], [1], [R, 1] or [R, G] scale as a 2D view with broadcasting (0) strides."""
    scale = scale.float().reshape(scale.shape[0] if scale.dim() else 1, -1)
    return scale, *(s if n > 1 else 0 for s, n in zip(scale.stride(), scale.shape))


def _config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages): decode-sized M streams weights."""
    if m <= 16:
        return 16, 64, 1, 4, 4
    if m <= 64:
        return 64, 64, 8, 4, 4
    return 128, 128, 8, 8, 3


@register("fp8_scaled_mm", "triton")
def fp8_scaled_mm_triton(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size):
    if block_size is not None and (block_size[1] < 16 or block_size[1] & (block_size[1] - 1)):
        # The K loop takes one scale per step, so its tile must divide the scale group.
        return fp8_scaled_mm_torch(a_q, a_scale, b_q, b_scale, out_dtype, bias, block_size)
    a_q = a_q if a_q.stride(-1) == 1 else a_q.contiguous()
    b_q = b_q if b_q.stride(-1) == 1 else b_q.contiguous()
    (m, k), n = a_q.shape, b_q.shape[0]
    a_scale, stride_asm, stride_ask = _scale_strides(a_scale)
    b_scale, stride_bsn, stride_bsk = _scale_strides(b_scale)
    group_n, group_k = block_size if block_size is not None else (1, 1)
    block_k = min(128, group_k) if block_size is not None else 128
    block_m, block_n, group_m, warps, stages = _config(m)
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_scaled_mm_kernel[grid](
        a_q, a_scale, b_q, b_scale, out if bias is None else bias, out, m, n, k,
        a_q.stride(0), b_q.stride(0), out.stride(0), stride_asm, stride_ask, stride_bsn, stride_bsk,
        GROUP_N=group_n, GROUP_K=group_k, SCALES_ALONG_K=bool(stride_ask or stride_bsk),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
