"""RMSNorm and fused residual-add + RMSNorm."""

from __future__ import annotations

import torch

from atom.kernels.policy import dispatch, register


@register("rms_norm", "torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32, the normalised value rounded to x.dtype, then the weight (HF order).
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@register("fused_add_rms_norm", "torch")
def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = (x + residual).to(x.dtype)
    return rms_norm_torch(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return dispatch("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    return dispatch("fused_add_rms_norm", x.device)(x, residual, weight, eps)
