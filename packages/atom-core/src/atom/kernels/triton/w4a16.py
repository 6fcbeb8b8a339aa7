"""W4A16 GEMM: 4-bit weights (the layout of atom.kernels.w4a16) dequantized in registers.

Two kernels, both accumulating in fp32 through tl.dot:

* small M (decode, M <= 16): the GEMM is a weight stream. Each packed word is loaded once
  ([BLOCK_K / 8, BLOCK_N] words per step); nibble j of word row i is K row 8i + j, so the
  step is eight dots, each of x's columns j::8 with nibble j of every word. Each nibble is
  dequantized where it lies, in the dot operand's own layout (sm_90 builds store no
  [BLOCK_K, BLOCK_N] tile to shared memory), with no int-to-float conversion.
  cdiv(N, BLOCK_N) programs alone leave most SMs idle (Qwen3-8B's down projection: 32
  128-wide tiles on 132 SMs), so K is split across programs: each writes its fp32 partial
  tile, and a second kernel sums the splits in a fixed order (deterministic, no atomics),
  adds the bias and casts.
* larger M: per K step the [BLOCK_K, BLOCK_N] codes (each word read by the eight rows it
  holds; they hit the same cache line), one row of scales and zeros (BLOCK_K divides the
  group), dequantized in fp32 and fed to one dot.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom.kernels.policy import capturable, register
from atom.kernels.triton.tiles import num_sms, tile_ranges

_FLOAT_2_23_BITS = tl.constexpr(0x4B000000)  # the fp32 bits of 2^23


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    stride_xm, stride_qk, stride_sg, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    rows, cols, row_ok, col_ok = tile_ranges(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
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


@triton.jit
def _columns_by_nibble(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] -> its eight column sets j::8 (j = 0..7), [BLOCK_M, BLOCK_K / 8]
    each: the columns that meet nibble j of the packed words."""
    x = tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))  # column 8i + 4a + 2b + c
    even, odd = tl.split(x)  # c
    x0_4, x2_6 = tl.split(even)  # b
    x1_5, x3_7 = tl.split(odd)
    x0, x4 = tl.split(x0_4)  # a
    x2, x6 = tl.split(x2_6)
    x1, x5 = tl.split(x1_5)
    x3, x7 = tl.split(x3_7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _nibble_dot(acc, x_j, half_words, p: tl.constexpr, scale, zero_scaled):
    """acc + x_j @ the weights in nibble p (0..3) of `half_words` (uint32, 16 bits used).

    No int-to-float conversion (16 a clock per SM on Hopper, against 128 fp32 operations):
    the nibble, masked in place (c * 16^p), is or-ed into the mantissa of 2^23, and
    subtracting 2^23 leaves c * 16^p exactly. Its scale is taken as scale / 16^p (exact), so
    a multiply-add (fused by Triton's default fp fusion) gives c * scale - zero * scale: the
    reference's (c - zero) * scale to the bit wherever zero * scale is exact in fp32 (integer
    zero points times scales from fp16 or bf16 checkpoints), else within one fp32 rounding."""
    biased = (half_words & (0xF << (4 * p))) | _FLOAT_2_23_BITS
    codes = biased.to(tl.float32, bitcast=True) - 8388608.0
    w = codes * (scale * (0.0625**p)) - zero_scaled
    return tl.dot(x_j, w.to(x_j.dtype), acc, input_precision="ieee")


@triton.jit
def _w4a16_small_m_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, M, N, K, group_size,
    split_len, stride_xm, stride_qk, stride_sg, stride_om, stride_split,
    HAS_BIAS: tl.constexpr, ONE_GROUP_PER_STEP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    rows, cols, row_ok, col_ok = tile_ranges(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_first = tl.program_id(1) * split_len
    k_end = tl.minimum(k_first + split_len, K)
    ks = tl.arange(0, BLOCK_K)
    word_rows = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k_first + ks)[None, :]
    q_ptrs = qweight_ptr + (k_first // 8 + word_rows).to(tl.int64)[:, None] * stride_qk
    q_ptrs += cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None] & (ks < K - k0)[None, :], other=0.0)
        words_ok = word_rows < (K - k0) // 8  # K is a whole number of words
        words = tl.load(q_ptrs, mask=words_ok[:, None] & col_ok[None, :], other=0)
        words = words.to(tl.uint32, bitcast=True)
        if ONE_GROUP_PER_STEP:
            group_ptrs = (k0 // group_size) * stride_sg + cols[None, :]
            group_ok = col_ok[None, :]
        else:  # word row i holds K rows k0 + 8i .. k0 + 8i + 7, all of one group
            group_ptrs = ((k0 + 8 * word_rows) // group_size)[:, None] * stride_sg + cols[None, :]
            group_ok = words_ok[:, None] & col_ok[None, :]
        scale = tl.load(scales_ptr + group_ptrs, mask=group_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + group_ptrs, mask=group_ok, other=0.0).to(tl.float32)
        zero_scaled = zero * scale
        x0, x1, x2, x3, x4, x5, x6, x7 = _columns_by_nibble(x, BLOCK_M, BLOCK_K)
        acc = _nibble_dot(acc, x0, words, 0, scale, zero_scaled)
        acc = _nibble_dot(acc, x1, words, 1, scale, zero_scaled)
        acc = _nibble_dot(acc, x2, words, 2, scale, zero_scaled)
        acc = _nibble_dot(acc, x3, words, 3, scale, zero_scaled)
        high = words >> 16  # nibbles 4..7 as 0..3
        acc = _nibble_dot(acc, x4, high, 0, scale, zero_scaled)
        acc = _nibble_dot(acc, x5, high, 1, scale, zero_scaled)
        acc = _nibble_dot(acc, x6, high, 2, scale, zero_scaled)
        acc = _nibble_dot(acc, x7, high, 3, scale, zero_scaled)
        x_ptrs += BLOCK_K
        q_ptrs += (BLOCK_K // 8) * stride_qk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + tl.program_id(1) * stride_split
    out_ptrs += rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    partial_ptr, bias_ptr, out_ptr, numel, N, num_splits, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    acc = tl.load(partial_ptr + offsets, mask=ok, other=0.0)
    for split in range(1, num_splits):
        acc += tl.load(partial_ptr + split * numel + offsets, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offsets % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


class W4a16Config(NamedTuple):
    """One launch: the output tile, the K step, the number of K splits (fewer if the last
    would be empty; small M only) and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


SMALL_M = 16  # up to here one M tile covers the batch and the weights decide the time
_MAX_SPLIT_K = 16
_MIN_SPLIT_LEN = 512  # K rows per split: shorter splits spend their time filling the pipeline


def pick_w4a16_config(m: int, n: int, k: int, sms: int) -> W4a16Config:
    """Defaults: for small M, 128-wide tiles and K splits until there are two programs per
    SM, which came within a few percent of the fastest candidate of benchmarks/w4a16.py
    --sweep on every Qwen3-8B layer (docs/performance.md, "W4A16 small-M launch")."""
    if m <= SMALL_M:
        block_n = 128
        split = 1
        while (
            split < _MAX_SPLIT_K
            and triton.cdiv(n, block_n) * split < 2 * sms
            and k >= 2 * split * _MIN_SPLIT_LEN
        ):
            split *= 2
        return W4a16Config(SMALL_M, block_n, 128, split, 4, 3)
    if m <= 64:
        return W4a16Config(64, 64, 64, 1, 4, 4)
    return W4a16Config(128, 128, 64, 1, 8, 3)


@capturable
@register("w4a16_gemm", "triton")
def w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bias, config=None):
    """`config` (a W4a16Config) overrides the default launch; benchmarks/w4a16.py --sweep
    times candidates through it."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    (m, k), n = x.shape, qweight.shape[1]
    if group_size % 32 and group_size != k:
        raise ValueError(f"w4a16_gemm_triton: group_size {group_size} is not a multiple of 32")
    config = config or pick_w4a16_config(m, n, k, num_sms(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= SMALL_M:
        _small_m_gemm(x, qweight, scales, zeros, group_size, bias, config, out)
        return out
    if config.split_k != 1:
        raise ValueError(f"w4a16_gemm_triton: split_k {config.split_k} needs M <= {SMALL_M}")
    # One scale row per K step: the step must not cross a group boundary (a per-channel
    # group spans all of K, so any step does).
    block_k = 32 if group_size % 64 else config.block_k
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros, out if bias is None else bias, out, m, n, k, group_size,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _small_m_gemm(x, qweight, scales, zeros, group_size, bias, config, out):
    (m, k), n = x.shape, qweight.shape[1]
    if config.block_m != SMALL_M or config.block_k < 128:
        # Each of a step's eight dots spans BLOCK_K / 8 rows of K: tl.dot needs 16.
        raise ValueError(f"w4a16_gemm_triton: small-M config {config} needs block_m "
                         f"{SMALL_M} and block_k >= 128")  # fmt: skip
    steps_per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k)
    split_len = steps_per_split * config.block_k
    splits = triton.cdiv(k, split_len)
    partial = out if splits == 1 else torch.empty(splits, m, n, device=x.device)
    _w4a16_small_m_kernel[(triton.cdiv(n, config.block_n), splits)](
        x, qweight, scales, zeros, out if bias is None else bias, partial, m, n, k, group_size,
        split_len, x.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
        HAS_BIAS=bias is not None and splits == 1,
        ONE_GROUP_PER_STEP=group_size == k or group_size % config.block_k == 0,
        BLOCK_M=SMALL_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=1,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            partial, out if bias is None else bias, out, m * n, n, splits,
            HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
