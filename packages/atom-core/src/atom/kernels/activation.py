"""Gated activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.kernels.policy import dispatch, register


@register("silu_and_mul", "torch")
def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of width 2d."""
    return dispatch("silu_and_mul", x.device)(x)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: the gate clamped above at `limit`, the up projection to
    [-limit, limit], then (up + up_shift) * gate * sigmoid(alpha * gate). The MoE kernels
    take it in place of "silu"; calling it is the torch definition on x [..., 2d] (gate |
    up). DeepSeek-V4's experts are the same clamps around plain SwiGLU: alpha 1, up_shift 0
    (`clamped_silu`)."""

    alpha: float = 1.702
    limit: float = 7.0
    up_shift: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + self.up_shift) * gate * torch.sigmoid(gate * self.alpha)


def clamped_silu(limit: float) -> ClampedSwiGLU:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): DeepSeek-V4's expert activation."""
    return ClampedSwiGLU(alpha=1.0, limit=limit, up_shift=0.0)
