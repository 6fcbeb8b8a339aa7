"""The chunk-local part of the chunked gated delta rule in two light kernels, instead of
atom.kernels.triton.gated_delta_prepare's one (ChunkLaunch(prepare="staged") selects it).

The fused prepare kernel keeps a chunk's keys and values in fp32 ([64, 128] each) live
next to ten inverse tiles and spills. This splits it where the working set changes, as
FLA's chunked delta rule does (its K K^T, triangular solve and W/U recompute kernels):

- inverse: per (chunk, value head), the cumulative log decay, A = diag(beta) K K^T with
  the decay ratios, and (I + A)^-1 by [16, 16] blocks (forward substitution on the
  diagonal, block substitution below, fp32). K K^T is taken on the raw keys in the input
  dtype (tensor cores, fp32 accumulate: exact products of bf16 inputs); the l2 norm
  enters as the row and column scales r_i r_j afterwards. It stores (I + A)^-1 twice,
  its columns scaled for W and for U, into token-indexed [T, Hv, C] scratch in the input
  dtype: W = (I + A)^-1 diag(beta G r) K and U = (I + A)^-1 diag(beta) V, so the second
  kernel multiplies raw inputs and nothing else is rounded.
- apply: per (chunk, value head), W and U as [C, C] x [C, 64] products over 64-wide
  column tiles of K and V, in the input dtype with fp32 accumulate; only one [C, C]
  operand and one tile are live.

The extra traffic is the two [C, C] inverses per (chunk, head): at C = 64 and bf16, 16 KB
against the 64 KB of K, V, W and U that both forms move.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atom.kernels.triton.gated_delta_prepare import (
    L2NORM_EPS,
    SUB,
    _block_rows,
    _fp32_dot,
    _invert_diagonal_blocks,
    chunk_program,
)

# Columns of K and V one tensor-core product of the apply kernel takes.
APPLY_TILE = 64


@triton.jit
def mma_operand(x, DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """x rounded to the dtype tl.dot takes (the input dtype for tensor cores). Triton's
    interpreter multiplies bf16 tiles wrongly, so there it goes back to fp32 after the
    rounding: the CPU tests still see the rounding, and exact products of what is left."""
    x = x.to(DOT_DTYPE)
    if INTERPRETED:
        x = x.to(tl.float32)
    return x


@triton.jit
def load_tile(ptr, rows, row_mask, stride_t, head_offset, cols, dim):
    """[rows, cols] of one head in its stored dtype; zeros outside the sequence and past dim."""
    ptrs = ptr + rows[:, None] * stride_t + head_offset + cols[None, :]
    return tl.load(ptrs, mask=row_mask[:, None] & (cols[None, :] < dim), other=0.0)


@triton.jit
def _decay_block(rows, valid, cum_before, g_head, beta_head, g_stride_t, beta_stride_t):
    """A row block's beta and cumulative log decay from the chunk start, and that decay at
    its end; rows outside the chunk get beta = g = 0."""
    g = tl.load(g_head + rows * g_stride_t, mask=valid, other=0.0)
    beta = tl.load(beta_head + rows * beta_stride_t, mask=valid, other=0.0).to(tl.float32)
    cum = cum_before + tl.cumsum(g, axis=0)
    return beta, cum, cum_before + tl.sum(g, axis=0)


@triton.jit
def _key_block(k_head, rows, valid, k_stride_t, kcols, dk, DOT_DTYPE: tl.constexpr,
               INTERPRETED: tl.constexpr, L2NORM: tl.constexpr):  # fmt: skip
    """A row block's raw keys as a tensor-core operand, and their inverse l2 norms
    (1 without the norm)."""
    k = load_tile(k_head, rows, valid, k_stride_t, 0, kcols, dk)
    r = tl.full([SUB], 1.0, tl.float32)
    if L2NORM:
        kf = k.to(tl.float32)
        r = tl.rsqrt(tl.sum(kf * kf, axis=1) + L2NORM_EPS)
    return mma_operand(k, DOT_DTYPE, INTERPRETED), r


@triton.jit
def _a_block(k_i, k_j, beta_i, r_i, r_j, cum_i, cum_j, DIAGONAL: tl.constexpr,
             PRECISION: tl.constexpr):  # fmt: skip
    """Block (i, j) of A: beta_i r_i r_j (k_i . k_j) G_i / G_j, fp32; a diagonal one
    strictly lower (exp only there, where the decay ratio is <= 1)."""
    exponent = cum_i[:, None] - cum_j[None, :]
    if DIAGONAL:
        s = tl.arange(0, SUB)
        exponent = tl.where(s[:, None] > s[None, :], exponent, float("-inf"))
    kk = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION)
    return (beta_i * r_i)[:, None] * kk * (r_j[None, :] * tl.exp(exponent))


@triton.jit
def _store_block(ptr, rows, valid, num_v_heads, head, CHUNK: tl.constexpr,
                 col_block: tl.constexpr, col_valid, x, col_scale):  # fmt: skip
    """Block (row block, col_block) of a [C, C] matrix, its columns scaled by col_scale,
    into token-indexed [T, Hv, C] scratch. Columns of tokens past the sequence stay
    unwritten: the apply kernel masks them."""
    cols = col_block * SUB + tl.arange(0, SUB)
    ptrs = ptr + ((rows * num_v_heads + head) * CHUNK)[:, None] + cols[None, :]
    value = (x * col_scale[None, :]).to(ptr.dtype.element_ty)
    tl.store(ptrs, value, mask=valid[:, None] & col_valid[None, :])


@triton.jit
def _store_lower(ptr, rows0, rows1, rows2, rows3, valid0, valid1, valid2, valid3,
                 num_v_heads, head, CHUNK: tl.constexpr,
                 d0, inv10, d1, inv20, inv21, d2, inv30, inv31, inv32, d3,
                 s0, s1, s2, s3):  # fmt: skip
    """The ten lower blocks of (I + A)^-1 diag(s) (the upper ones are never read)."""
    grid = (num_v_heads, head, CHUNK)
    _store_block(ptr, rows0, valid0, *grid, 0, valid0, d0, s0)
    _store_block(ptr, rows1, valid1, *grid, 0, valid0, inv10, s0)
    _store_block(ptr, rows1, valid1, *grid, 1, valid1, d1, s1)
    _store_block(ptr, rows2, valid2, *grid, 0, valid0, inv20, s0)
    _store_block(ptr, rows2, valid2, *grid, 1, valid1, inv21, s1)
    _store_block(ptr, rows2, valid2, *grid, 2, valid2, d2, s2)
    _store_block(ptr, rows3, valid3, *grid, 0, valid0, inv30, s0)
    _store_block(ptr, rows3, valid3, *grid, 1, valid1, inv31, s1)
    _store_block(ptr, rows3, valid3, *grid, 2, valid2, inv32, s2)
    _store_block(ptr, rows3, valid3, *grid, 3, valid3, d3, s3)


@triton.jit
def chunk_inverse_kernel(
    k_ptr, g_ptr, beta_ptr, inv_w_ptr, inv_u_ptr, cum_ptr, chunk_start_ptr, chunk_end_ptr,
    k_stride_t, k_stride_h, g_stride_t, g_stride_h, beta_stride_t, beta_stride_h,
    num_v_heads, group, dk,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, L2NORM: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head): the in-chunk log decay, and (I + A)^-1 with its
    columns scaled by beta G r (for W) and by beta (for U)."""
    chunk, head, key_head, start, end = chunk_program(chunk_start_ptr, chunk_end_ptr, group)
    kcols = tl.arange(0, BLOCK_K)
    k_head = k_ptr + key_head * k_stride_h
    g_head = g_ptr + head * g_stride_h
    beta_head = beta_ptr + head * beta_stride_h
    decay = (g_head, beta_head, g_stride_t, beta_stride_t)
    # Constexprs stay out of the tuples: Triton 3.6 cannot hold a dtype in one.
    keys = (k_stride_t, kcols, dk)

    rows0, valid0 = _block_rows(start, end, 0, CHUNK)
    rows1, valid1 = _block_rows(start, end, 1, CHUNK)
    rows2, valid2 = _block_rows(start, end, 2, CHUNK)
    rows3, valid3 = _block_rows(start, end, 3, CHUNK)
    beta0, cum0, cum_end = _decay_block(rows0, valid0, 0.0, *decay)
    beta1, cum1, cum_end = _decay_block(rows1, valid1, cum_end, *decay)
    beta2, cum2, cum_end = _decay_block(rows2, valid2, cum_end, *decay)
    beta3, cum3, _ = _decay_block(rows3, valid3, cum_end, *decay)
    tl.store(cum_ptr + rows0 * num_v_heads + head, cum0, mask=valid0)
    tl.store(cum_ptr + rows1 * num_v_heads + head, cum1, mask=valid1)
    tl.store(cum_ptr + rows2 * num_v_heads + head, cum2, mask=valid2)
    tl.store(cum_ptr + rows3 * num_v_heads + head, cum3, mask=valid3)
    k0, r0 = _key_block(k_head, rows0, valid0, *keys, DOT_DTYPE, INTERPRETED, L2NORM)
    k1, r1 = _key_block(k_head, rows1, valid1, *keys, DOT_DTYPE, INTERPRETED, L2NORM)
    k2, r2 = _key_block(k_head, rows2, valid2, *keys, DOT_DTYPE, INTERPRETED, L2NORM)
    k3, r3 = _key_block(k_head, rows3, valid3, *keys, DOT_DTYPE, INTERPRETED, L2NORM)

    d0, d1, d2, d3 = _invert_diagonal_blocks(
        _a_block(k0, k0, beta0, r0, r0, cum0, cum0, True, PRECISION),
        _a_block(k1, k1, beta1, r1, r1, cum1, cum1, True, PRECISION),
        _a_block(k2, k2, beta2, r2, r2, cum2, cum2, True, PRECISION),
        _a_block(k3, k3, beta3, r3, r3, cum3, cum3, True, PRECISION),
    )
    # Below the diagonal: Inv_ij = -Inv_ii sum_{j <= m < i} A_im Inv_mj (fp32, small).
    a10 = _a_block(k1, k0, beta1, r1, r0, cum1, cum0, False, PRECISION)
    inv10 = -_fp32_dot(d1, _fp32_dot(a10, d0))
    a20 = _a_block(k2, k0, beta2, r2, r0, cum2, cum0, False, PRECISION)
    a21 = _a_block(k2, k1, beta2, r2, r1, cum2, cum1, False, PRECISION)
    inv21 = -_fp32_dot(d2, _fp32_dot(a21, d1))
    inv20 = -_fp32_dot(d2, _fp32_dot(a21, inv10, _fp32_dot(a20, d0)))
    a30 = _a_block(k3, k0, beta3, r3, r0, cum3, cum0, False, PRECISION)
    a31 = _a_block(k3, k1, beta3, r3, r1, cum3, cum1, False, PRECISION)
    a32 = _a_block(k3, k2, beta3, r3, r2, cum3, cum2, False, PRECISION)
    inv32 = -_fp32_dot(d3, _fp32_dot(a32, d2))
    inv31 = -_fp32_dot(d3, _fp32_dot(a32, inv21, _fp32_dot(a31, d1)))
    inv30 = -_fp32_dot(d3, _fp32_dot(a32, inv20, _fp32_dot(a31, inv10, _fp32_dot(a30, d0))))
    inverse = (d0, inv10, d1, inv20, inv21, d2, inv30, inv31, inv32, d3)

    blocks = (rows0, rows1, rows2, rows3, valid0, valid1, valid2, valid3, num_v_heads, head)
    _store_lower(inv_u_ptr, *blocks, CHUNK, *inverse, beta0, beta1, beta2, beta3)
    _store_lower(
        inv_w_ptr, *blocks, CHUNK, *inverse, beta0 * r0 * tl.exp(cum0),
        beta1 * r1 * tl.exp(cum1), beta2 * r2 * tl.exp(cum2), beta3 * r3 * tl.exp(cum3),
    )  # fmt: skip


@triton.jit
def _apply_inverse(inv_ptr, x_ptr, out_ptr, rows, valid, x_stride_t, x_head_offset, dim,
                   num_v_heads, head, start, end, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   TILE: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   INTERPRETED: tl.constexpr):  # fmt: skip
    """out = Inv X for a chunk: Inv [C, C] (lower; columns of tokens past the sequence
    masked) from scratch, X [C, dim] raw from the input, TILE columns at a time."""
    idx = tl.arange(0, CHUNK)
    inv_ptrs = inv_ptr + ((rows * num_v_heads + head) * CHUNK)[:, None] + idx[None, :]
    inv_mask = valid[:, None] & (idx[None, :] <= idx[:, None]) & ((start + idx) < end)[None, :]
    inv = mma_operand(tl.load(inv_ptrs, mask=inv_mask, other=0.0), DOT_DTYPE, INTERPRETED)
    for first in tl.static_range(0, BLOCK, TILE):
        cols = first + tl.arange(0, TILE)
        x = load_tile(x_ptr, rows, valid, x_stride_t, x_head_offset, cols, dim)
        y = tl.dot(inv, mma_operand(x, DOT_DTYPE, INTERPRETED), input_precision=PRECISION)
        ptrs = out_ptr + ((rows * num_v_heads + head) * dim)[:, None] + cols[None, :]
        tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < dim))


@triton.jit
def chunk_apply_kernel(
    k_ptr, v_ptr, inv_w_ptr, inv_u_ptr, w_ptr, u_ptr, chunk_start_ptr, chunk_end_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, num_v_heads, group, dk, dv,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    TILE_K: tl.constexpr, TILE_V: tl.constexpr, PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head): W and U into token-indexed scratch."""
    chunk, head, key_head, start, end = chunk_program(chunk_start_ptr, chunk_end_ptr, group)
    rows = (start + tl.arange(0, CHUNK)).to(tl.int64)
    valid = rows < end
    common = (num_v_heads, head, start, end)  # constexprs apart, as in chunk_inverse_kernel
    _apply_inverse(inv_w_ptr, k_ptr, w_ptr, rows, valid, k_stride_t, key_head * k_stride_h, dk,
                   *common, CHUNK, BLOCK_K, TILE_K, PRECISION, DOT_DTYPE, INTERPRETED)  # fmt: skip
    _apply_inverse(inv_u_ptr, v_ptr, u_ptr, rows, valid, v_stride_t, head * v_stride_h, dv,
                   *common, CHUNK, BLOCK_V, TILE_V, PRECISION, DOT_DTYPE, INTERPRETED)  # fmt: skip
