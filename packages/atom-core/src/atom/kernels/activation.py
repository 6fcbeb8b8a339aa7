"""Gated activations."""

from __future__ import annotations

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
