"""RMSNorm and fused residual-add + RMSNorm through aiter (aiter/ops/rmsnorm.py)."""

from __future__ import annotations

import aiter
import torch

from atom.kernels.aiter.common import HALF_DTYPES, next_backend
from atom.kernels.policy import register


def _takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return (
        x.numel() > 0
        and x.dtype in HALF_DTYPES
        and weight.dtype == x.dtype
        and (residual is None or residual.dtype == x.dtype)
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


@register("rms_norm", "aiter")
def rms_norm_aiter(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _takes(x, weight):
        return next_backend("rms_norm", x.device)(x, weight, eps)
    # rmsnorm2d_fwd(input, weight, epsilon) -> out
    return aiter.rmsnorm2d_fwd(_rows(x), weight.contiguous(), eps).view(x.shape)


@register("fused_add_rms_norm", "aiter")
def fused_add_rms_norm_aiter(x, residual, weight, eps):
    if not _takes(x, weight, residual):
        return next_backend("fused_add_rms_norm", x.device)(x, residual, weight, eps)
    x2d = _rows(x)
    out, residual_out = torch.empty_like(x2d), torch.empty_like(x2d)
    # rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon):
    # out-of-place, so the caller's x and residual are left as they were (as the reference).
    aiter.rmsnorm2d_fwd_with_add(out, x2d, _rows(residual), residual_out, weight.contiguous(), eps)
    return out.view(x.shape), residual_out.view(x.shape)
