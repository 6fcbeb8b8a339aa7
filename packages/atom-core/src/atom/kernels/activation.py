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
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). The MoE kernels take it
    in place of "silu"; calling it is the torch definition on x [..., 2d] (gate | up)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
