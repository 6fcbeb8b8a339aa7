"""SiLU(gate) * up through aiter (aiter/ops/activation.py)."""

from __future__ import annotations

import aiter
import torch

from atom.kernels.aiter.common import HALF_DTYPES, next_backend
from atom.kernels.policy import register


@register("silu_and_mul", "aiter")
def silu_and_mul_aiter(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0 or x.dtype not in HALF_DTYPES or x.shape[-1] % 2:
        return next_backend("silu_and_mul", x.device)(x)
    d = x.shape[-1] // 2
    x2d = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty(x2d.shape[0], d, dtype=x.dtype, device=x.device)
    aiter.silu_and_mul(out, x2d)  # silu_and_mul(out, input): activation on the first half
    return out.view(*x.shape[:-1], d)
