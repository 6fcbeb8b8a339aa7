"""RMSNorm and its variants in one kernel: one program per row of the last dim.

Rows are (token, head) pairs, addressed through each tensor's two leading strides, so a
head-split view (Qwen3-Next's q and output gate, Gated DeltaNet's z) is read in place. The
variants keep their references' rounding order (atom.kernels.norm): plain RMSNorm rounds
the normalised value to x's dtype before the weight; the zero-centred norm scales the fp32
value by (1 + w) and rounds once; the gated norm rounds the weighted value, then gates it
by silu(gate) in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import register


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, gate_ptr, weight_ptr, out_ptr, residual_out_ptr,
    heads, x_stride_t, x_stride_h, residual_stride_t, residual_stride_h,
    gate_stride_t, gate_stride_h, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + token * x_stride_t + head * x_stride_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        offset = token * residual_stride_t + head * residual_stride_h
        x += tl.load(residual_ptr + offset + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    if ZERO_CENTRED:
        out = normed * (1.0 + weight.to(tl.float32))
    else:
        out = weight * normed.to(x.dtype)
    if HAS_GATE:
        offset = token * gate_stride_t + head * gate_stride_h
        gate = tl.load(gate_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
        out = out.to(tl.float32) * gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, int, int]:
    """t as [tokens, heads, D] (`shape`, x's) with a unit last stride, and its token and
    head strides: a view where t's layout allows one (rows, head-split views), else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.reshape(shape)
    return rows, rows.stride(0), rows.stride(1)


def _launch(x, weight, eps, residual=None, gate=None, zero_centred=False, out_dtype=None):
    """(out, x + residual) in x's shape; out and the new residual are contiguous."""
    n_cols = x.shape[-1]
    heads = x.shape[-2] if x.dim() >= 3 else 1
    shape = (x.numel() // (heads * n_cols), heads, n_cols)
    xr, x_stride_t, x_stride_h = _rows(x, shape)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    residual_out = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rr, r_stride_t, r_stride_h = (xr, 0, 0) if residual is None else _rows(residual, shape)
    gr, g_stride_t, g_stride_h = (xr, 0, 0) if gate is None else _rows(gate, shape)
    _rms_norm_kernel[(shape[0] * heads,)](
        xr, rr, gr, weight, out, residual_out,
        heads, x_stride_t, x_stride_h, r_stride_t, r_stride_h, g_stride_t, g_stride_h,
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTRED=zero_centred, HAS_GATE=gate is not None,
        BLOCK=triton.next_power_of_2(n_cols),
    )  # fmt: skip
    return out, residual_out


@register("rms_norm", "triton")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, out_dtype=torch.promote_types(x.dtype, weight.dtype))[0]


@register("fused_add_rms_norm", "triton")
def fused_add_rms_norm_triton(x, residual, weight, eps):
    return _launch(x, weight, eps, residual, out_dtype=torch.promote_types(x.dtype, weight.dtype))


@register("zero_centred_rms_norm", "triton")
def zero_centred_rms_norm_triton(x, weight, eps, residual=None):
    out, new_residual = _launch(x, weight, eps, residual, zero_centred=True)
    return out if residual is None else (out, new_residual)


@register("gated_rms_norm", "triton")
def gated_rms_norm_triton(x, gate, weight, eps):
    return _launch(x, weight, eps, gate=gate)[0]
