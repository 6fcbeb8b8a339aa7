"""The chunk-local part of the chunked gated delta rule (see atom.kernels.triton.gated_delta):
per (chunk, value head), U = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta G) K and the
in-chunk log decay, into token-indexed scratch (W and U in the scratch dtype, the decay in
fp32).

(I + A)^-1 is unit lower triangular. The prepare kernel splits it into [16, 16] blocks
(at most four a side, so C <= 64): each diagonal block L_ii = I + A_ii is inverted by
forward substitution (15 steps, the four blocks in one loop), and the blocks below follow
by block forward substitution, Inv_ij = -Inv_ii sum_{j <= m < i} A_im Inv_mj, a few
16 x 16 products in fp32. Chunks of 16 or 32 run the same four blocks, the rows past the
chunk masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

L2NORM_EPS = tl.constexpr(1e-6)  # inside the square root, as HF's (and fla's) l2norm
# Rows of a diagonal block of I + A (the smallest tile tl.dot takes); the prepare kernel
# inverts four of them, so a chunk has at most 4 * SUB tokens.
SUB = tl.constexpr(16)
MAX_CHUNK = 4 * SUB.value


@triton.jit
def load_rows(ptr, rows, row_mask, stride_t, head_offset, cols, dim):
    """[rows, cols] of one head, as fp32; zeros outside the sequence and past `dim`."""
    ptrs = ptr + rows[:, None] * stride_t + head_offset + cols[None, :]
    mask = row_mask[:, None] & (cols[None, :] < dim)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def l2_normalize(x, axis: tl.constexpr, L2NORM: tl.constexpr):
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=axis, keep_dims=True) + L2NORM_EPS)
    return x


@triton.jit
def _block_rows(start, end, block: tl.constexpr, CHUNK: tl.constexpr):
    """Rows block * SUB .. of a chunk; those past the chunk or the sequence are invalid."""
    local = block * SUB + tl.arange(0, SUB)
    rows = (start + local).to(tl.int64)
    return rows, (local < CHUNK) & (rows < end)


@triton.jit
def _key_block(rows, valid, cum_before, k_head, g_head, beta_head, k_stride_t, g_stride_t,
               beta_stride_t, kcols, dk, L2NORM: tl.constexpr):  # fmt: skip
    """A row block's keys, beta and cumulative log decay from the chunk start, and that
    decay at its end. Invalid rows get g = beta = 0 and zero keys: they write nothing."""
    k = load_rows(k_head, rows, valid, k_stride_t, 0, kcols, dk)
    g = tl.load(g_head + rows * g_stride_t, mask=valid, other=0.0)
    beta = tl.load(beta_head + rows * beta_stride_t, mask=valid, other=0.0).to(tl.float32)
    cum = cum_before + tl.cumsum(g, axis=0)
    return l2_normalize(k, 1, L2NORM), beta, cum, cum_before + tl.sum(g, axis=0)


@triton.jit
def _gram_block(k_i, k_j, beta_i, cum_i, cum_j, DIAGONAL: tl.constexpr, PRECISION: tl.constexpr):
    """Block (i, j) of A, beta_i (k_i . k_j) G_i / G_j; a diagonal block strictly lower."""
    exponent = cum_i[:, None] - cum_j[None, :]
    if DIAGONAL:  # exp only below the diagonal, where the decay ratio is <= 1
        r = tl.arange(0, SUB)
        exponent = tl.where(r[:, None] > r[None, :], exponent, float("-inf"))
    kk = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION)
    return beta_i[:, None] * kk * tl.exp(exponent)


@triton.jit
def _substitute_row(a, inverse, r, i):
    """Row i of (I + a)^-1, a strictly lower, from the rows above it: e_i - sum_j a_ij row j."""
    a_row = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)
    row = tl.where(r == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, axis=0)
    return tl.where(r[:, None] == i, row[None, :], inverse)


@triton.jit
def _invert_diagonal_blocks(a0, a1, a2, a3):
    """(I + a)^-1 of four strictly lower [SUB, SUB] tiles by forward substitution in fp32,
    in one loop so that the four independent solves overlap."""
    r = tl.arange(0, SUB)
    d0 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    d1, d2, d3 = d0, d0, d0
    for i in range(1, SUB):
        d0 = _substitute_row(a0, d0, r, i)
        d1 = _substitute_row(a1, d1, r, i)
        d2 = _substitute_row(a2, d2, r, i)
        d3 = _substitute_row(a3, d3, r, i)
    return d0, d1, d2, d3


@triton.jit
def _fp32_dot(a, b, acc=None):
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _block_lower_times(l00, l10, l11, l20, l21, l22, l30, l31, l32, l33, x0, x1, x2, x3,
                       PRECISION: tl.constexpr):  # fmt: skip
    """The four row blocks of L X, for L block lower triangular and X in four row blocks."""
    y0 = tl.dot(l00, x0, input_precision=PRECISION)
    y1 = tl.dot(l10, x0, input_precision=PRECISION)
    y1 = tl.dot(l11, x1, y1, input_precision=PRECISION)
    y2 = tl.dot(l20, x0, input_precision=PRECISION)
    y2 = tl.dot(l21, x1, y2, input_precision=PRECISION)
    y2 = tl.dot(l22, x2, y2, input_precision=PRECISION)
    y3 = tl.dot(l30, x0, input_precision=PRECISION)
    y3 = tl.dot(l31, x1, y3, input_precision=PRECISION)
    y3 = tl.dot(l32, x2, y3, input_precision=PRECISION)
    y3 = tl.dot(l33, x3, y3, input_precision=PRECISION)
    return y0, y1, y2, y3


@triton.jit
def _beta_values(rows, valid, beta, v_ptr, v_stride_t, head_offset, vcols, dv):
    return load_rows(v_ptr, rows, valid, v_stride_t, head_offset, vcols, dv) * beta[:, None]


@triton.jit
def store_rows(ptr, rows, valid, num_v_heads, head, cols, dim, x):
    """x into token-indexed scratch [T, Hv, width]: rows of one head, columns below dim."""
    ptrs = ptr + ((rows * num_v_heads + head) * dim)[:, None] + cols[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < dim))


@triton.jit
def chunk_program(chunk_start_ptr, chunk_end_ptr, group):
    """(chunk, value head, key head, first token, sequence end) of a program of a grid over
    (chunk, value head, ...)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    return (
        chunk,
        head,
        head // group,
        tl.load(chunk_start_ptr + chunk),
        tl.load(chunk_end_ptr + chunk),
    )


@triton.jit
def chunk_prepare_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, cum_ptr, chunk_start_ptr, chunk_end_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, g_stride_t, g_stride_h,
    beta_stride_t, beta_stride_h, num_v_heads, group, dk, dv,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head): U, W and the in-chunk log decay, into
    token-indexed scratch ([T, Hv, ...])."""
    chunk, head, key_head, start, end = chunk_program(chunk_start_ptr, chunk_end_ptr, group)
    kcols = tl.arange(0, BLOCK_K)
    vcols = tl.arange(0, BLOCK_V)

    # (I + A)^-1 in [SUB, SUB] blocks: the four diagonal ones by forward substitution,
    # then below them Inv_ij = -Inv_ii sum_{j <= m < i} A_im Inv_mj, in fp32.
    k_head = k_ptr + key_head * k_stride_h
    g_head = g_ptr + head * g_stride_h
    beta_head = beta_ptr + head * beta_stride_h
    per_block = (
        k_head,
        g_head,
        beta_head,
        k_stride_t,
        g_stride_t,
        beta_stride_t,
        kcols,
        dk,
        L2NORM,
    )
    rows0, valid0 = _block_rows(start, end, 0, CHUNK)
    rows1, valid1 = _block_rows(start, end, 1, CHUNK)
    rows2, valid2 = _block_rows(start, end, 2, CHUNK)
    rows3, valid3 = _block_rows(start, end, 3, CHUNK)
    k0, beta0, cum0, cum_end = _key_block(rows0, valid0, 0.0, *per_block)
    k1, beta1, cum1, cum_end = _key_block(rows1, valid1, cum_end, *per_block)
    k2, beta2, cum2, cum_end = _key_block(rows2, valid2, cum_end, *per_block)
    k3, beta3, cum3, _ = _key_block(rows3, valid3, cum_end, *per_block)
    tl.store(cum_ptr + rows0 * num_v_heads + head, cum0, mask=valid0)
    tl.store(cum_ptr + rows1 * num_v_heads + head, cum1, mask=valid1)
    tl.store(cum_ptr + rows2 * num_v_heads + head, cum2, mask=valid2)
    tl.store(cum_ptr + rows3 * num_v_heads + head, cum3, mask=valid3)
    d0, d1, d2, d3 = _invert_diagonal_blocks(
        _gram_block(k0, k0, beta0, cum0, cum0, True, PRECISION),
        _gram_block(k1, k1, beta1, cum1, cum1, True, PRECISION),
        _gram_block(k2, k2, beta2, cum2, cum2, True, PRECISION),
        _gram_block(k3, k3, beta3, cum3, cum3, True, PRECISION),
    )
    a10 = _gram_block(k1, k0, beta1, cum1, cum0, False, PRECISION)
    inv10 = -_fp32_dot(d1, _fp32_dot(a10, d0))
    a20 = _gram_block(k2, k0, beta2, cum2, cum0, False, PRECISION)
    a21 = _gram_block(k2, k1, beta2, cum2, cum1, False, PRECISION)
    inv21 = -_fp32_dot(d2, _fp32_dot(a21, d1))
    inv20 = -_fp32_dot(d2, _fp32_dot(a21, inv10, _fp32_dot(a20, d0)))
    a30 = _gram_block(k3, k0, beta3, cum3, cum0, False, PRECISION)
    a31 = _gram_block(k3, k1, beta3, cum3, cum1, False, PRECISION)
    a32 = _gram_block(k3, k2, beta3, cum3, cum2, False, PRECISION)
    inv32 = -_fp32_dot(d3, _fp32_dot(a32, d2))
    inv31 = -_fp32_dot(d3, _fp32_dot(a32, inv21, _fp32_dot(a31, d1)))
    inv30 = -_fp32_dot(d3, _fp32_dot(a32, inv20, _fp32_dot(a31, inv10, _fp32_dot(a30, d0))))
    inverse = (d0, inv10, d1, inv20, inv21, d2, inv30, inv31, inv32, d3)

    # W = (I + A)^-1 diag(beta G) K and U = (I + A)^-1 diag(beta) V, row block by row block.
    w0, w1, w2, w3 = _block_lower_times(
        *inverse, k0 * (beta0 * tl.exp(cum0))[:, None], k1 * (beta1 * tl.exp(cum1))[:, None],
        k2 * (beta2 * tl.exp(cum2))[:, None], k3 * (beta3 * tl.exp(cum3))[:, None], PRECISION,
    )  # fmt: skip
    store_rows(w_ptr, rows0, valid0, num_v_heads, head, kcols, dk, w0)
    store_rows(w_ptr, rows1, valid1, num_v_heads, head, kcols, dk, w1)
    store_rows(w_ptr, rows2, valid2, num_v_heads, head, kcols, dk, w2)
    store_rows(w_ptr, rows3, valid3, num_v_heads, head, kcols, dk, w3)
    v_head = (v_ptr, v_stride_t, head * v_stride_h, vcols, dv)
    u0, u1, u2, u3 = _block_lower_times(
        *inverse, _beta_values(rows0, valid0, beta0, *v_head),
        _beta_values(rows1, valid1, beta1, *v_head), _beta_values(rows2, valid2, beta2, *v_head),
        _beta_values(rows3, valid3, beta3, *v_head), PRECISION,
    )  # fmt: skip
    store_rows(u_ptr, rows0, valid0, num_v_heads, head, vcols, dv, u0)
    store_rows(u_ptr, rows1, valid1, num_v_heads, head, vcols, dv, u1)
    store_rows(u_ptr, rows2, valid2, num_v_heads, head, vcols, dv, u2)
    store_rows(u_ptr, rows3, valid3, num_v_heads, head, vcols, dv, u3)
