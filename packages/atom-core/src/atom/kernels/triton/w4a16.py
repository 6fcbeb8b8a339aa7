"""W4A16 GEMM: 4-bit weights (the layout of atom.kernels.w4a16) dequantized in registers.

Each program computes a [BLOCK_M, BLOCK_N] tile of x @ W. Per K step it loads the
[BLOCK_K, BLOCK_N] codes from the packed words (each int32 word is read by the eight rows
it holds; they hit the same cache line), one row of scales and zeros (BLOCK_K divides the
group, so one group per step), dequantizes to the activation dtype and accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import capturable, register
from atom.kernels.triton.tiles import grouped_tile


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    shifts = (ks % 8) * 4
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    q_ptrs = qweight_ptr + (ks // 8).to(tl.int64)[:, None] * stride_qk + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        words = tl.load(q_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        codes = ((words >> shifts[:, None]) & 0xF).to(tl.float32)
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_sg + cols, mask=col_ok, other=0.0)
        zero = tl.load(zeros_ptr + group * stride_sg + cols, mask=col_ok, other=0.0)
        w = (codes - zero.to(tl.float32)[None, :]) * scale.to(tl.float32)[None, :]
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // 8) * stride_qk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages): decode-sized M streams weights."""
    if m <= 16:
        return 16, 64, 1, 4, 4
    if m <= 64:
        return 64, 64, 8, 4, 4
    return 128, 128, 8, 8, 3


@capturable
@register("w4a16_gemm", "triton")
def w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bias):
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    (m, k), n = x.shape, qweight.shape[1]
    # One scale row per K step: the step must not cross a group boundary (a per-channel
    # group spans all of K, so any step does).
    if group_size % 32 and group_size != k:
        raise ValueError(f"w4a16_gemm_triton: group_size {group_size} is not a multiple of 32")
    block_k = 32 if group_size % 64 else 64
    block_m, block_n, group_m, warps, stages = _config(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, out if bias is None else bias, out, m, n, k, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
