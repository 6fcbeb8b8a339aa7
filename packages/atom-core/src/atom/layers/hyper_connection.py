"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual as `hc_mult`
parallel streams instead of one.

Each block (attention or MoE) reads one input made of the streams and writes its output
back into all of them. Three weightings come from the streams themselves, through one
linear over their flattened, RMS-normalised values (no state, nothing cached):

- pre [N]: how much of each stream the block's input takes (sigmoid, + eps);
- post [N]: how much of the block's output each stream gets (2 * sigmoid);
- comb [N, N]: how the old streams mix into the new ones, pushed towards a doubly
  stochastic matrix by Sinkhorn steps (rows and columns summing to one keep the streams'
  norm from growing over many layers).

The new streams are post * out + comb^T @ streams. `HyperHead` collapses the streams into
one before the final norm. All of it runs in fp32, as the reference keeps it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, the statistics in fp32 (no weight)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """[..., N, N] positive -> near doubly stochastic: columns first, then `iterations - 1`
    rounds of rows and columns (the reference's order; it is not symmetric)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mHC: `collapse` gives the block input and the weights `expand` needs."""

    def __init__(
        self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ):
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult  # pre, post, comb
        self.fn = nn.Parameter(
            torch.empty(width, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (block input [T, D], post [T, N], comb [T, N, N])."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = (
            torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        )
        comb = sinkhorn(comb, self.sinkhorn_iters, self.hc_eps)
        block_input = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return block_input, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams [T, N, D]: post * block output + comb^T @ old streams (comb's first
        index is the old stream)."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The streams [T, N, D] -> one hidden state [T, D] (sigmoid weights, no Sinkhorn)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(
            torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
