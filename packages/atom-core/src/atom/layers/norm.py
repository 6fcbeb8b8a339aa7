from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from atom.distributed import get_tp_group
from atom.kernels import fused_add_rms_norm, gated_rms_norm, rms_norm, zero_centred_rms_norm
from atom.layers.linear import copy_shard
from atom.layers.quantization import set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features that tensor parallelism splits across ranks (MiniMax-M2
    normalises all q heads together, and all k heads): each rank holds the weight of its
    own `shard_size` features, shard `shard_index` of the checkpoint's vector, and the mean
    square is averaged over the ranks. Ranks that hold the same shard (replicated KV
    heads) count it equally often, so the average is still over every feature."""

    def __init__(self, shard_size: int, shard_index: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shard_size), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=partial(copy_shard, index=shard_index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sharded_rms_norm([x], [self])[0]


def sharded_rms_norm(
    inputs: Sequence[torch.Tensor], norms: Sequence[ShardedRMSNorm]
) -> list[torch.Tensor]:
    """Each input normalised by its norm, the ranks' mean squares of all of them summed in
    one all-reduce. The torch reference's order: fp32 statistics, the normalised value
    rounded to the input dtype, then the weight."""
    mean_squares = torch.stack([x.float().pow(2).mean(-1) for x in inputs], dim=-1)
    tp = get_tp_group()
    if tp.world_size > 1:
        mean_squares = tp.all_reduce(mean_squares) / tp.world_size
    return [
        norm.weight * (x.float() * torch.rsqrt(mean_square[..., None] + norm.eps)).to(x.dtype)
        for x, norm, mean_square in zip(inputs, norms, mean_squares.unbind(-1))
    ]


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight w is centred on zero and scales by (1 + w), in fp32
    before rounding to the input dtype (Qwen3-Next, Qwen3.5). With `residual`, x is added
    to it first and (normed, sum) returned, as `RMSNorm` does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return zero_centred_rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x then times silu(gate) (Gated DeltaNet's output norm): the normed value
    rounded to x's dtype and weighted, then gated in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
