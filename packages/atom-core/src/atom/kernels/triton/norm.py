"""RMSNorm and fused add + RMSNorm: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import register


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_stride, residual_stride, out_stride, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * out_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    normed = (x32 * inv_rms).to(x.dtype)
    tl.store(
        out_ptr + row * out_stride + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def _launch(x, residual, weight, eps):
    shape = x.shape
    x2d = x.reshape(-1, shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty_like(x2d) if residual is not None else out
    res2d = residual.reshape(-1, shape[-1]).contiguous() if residual is not None else x2d
    _rms_norm_kernel[(x2d.shape[0],)](
        x2d, res2d, weight, out, residual_out,
        x2d.stride(0), res2d.stride(0), out.stride(0), shape[-1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(shape[-1]),
    )  # fmt: skip
    return out.view(shape), residual_out.view(shape)


@register("rms_norm", "triton")
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


@register("fused_add_rms_norm", "triton")
def fused_add_rms_norm_triton(x, residual, weight, eps):
    return _launch(x, residual, weight, eps)
