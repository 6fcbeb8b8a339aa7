"""RMSNorm, fused residual-add + RMSNorm, and the two variants of Qwen3-Next and Qwen3.5:
the zero-centred norm (scales by 1 + w) and the gated norm of Gated DeltaNet's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.policy import dispatch, register


@register("rms_norm", "torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Variance in fp32, the normalised value rounded to x.dtype, then the weight (HF order).
    return weight * _normalised(x, eps).to(x.dtype)


@register("fused_add_rms_norm", "torch")
def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = (x + residual).to(x.dtype)
    return rms_norm_torch(residual, weight, eps), residual


@register("zero_centred_rms_norm", "torch")
def zero_centred_rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # The fp32 normalised value times (1 + w) in fp32, rounded once (HF's Qwen3NextRMSNorm).
    if residual is not None:
        x = residual = (x + residual).to(x.dtype)
    out = (_normalised(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, residual)


@register("gated_rms_norm", "torch")
def gated_rms_norm_torch(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    # HF's Qwen3NextRMSNormGated: the normalised value rounded to x.dtype and weighted,
    # then gated by silu(gate) in fp32.
    weighted = weight * _normalised(x, eps).to(x.dtype)
    return (weighted * F.silu(gate.float())).to(x.dtype)


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return dispatch("rms_norm", x.device)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    return dispatch("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def zero_centred_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm scaled by (1 + weight) in x.dtype; with `residual`, x is added to it first
    and (normed, sum) returned, as fused_add_rms_norm does."""
    return dispatch("zero_centred_rms_norm", x.device)(x, weight, eps, residual)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """weight * RMSNorm(x) * silu(gate) in x.dtype, over the last dim (gate: x's shape)."""
    return dispatch("gated_rms_norm", x.device)(x, gate, weight, eps)
