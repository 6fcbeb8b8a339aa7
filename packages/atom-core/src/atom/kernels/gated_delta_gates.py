"""Gated DeltaNet's per-token gates from its projections: the decay
g = -exp(A_log) * softplus(a + dt_bias) (fp32) and the write strength beta = sigmoid(b).

As torch ops these are about eight tiny kernels a layer, which at decode cost as much GPU
time as their launches; the Triton kernel (atom/kernels/triton/gated_delta_gates.py)
computes both in one, reading `a` and `b` where the projection left them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.policy import dispatch, register

GATED_DELTA_GATES_OP = "gated_delta_gates"


@register(GATED_DELTA_GATES_OP, "torch")
def gated_delta_gates_torch(a, b, A_log, dt_bias):
    heads = A_log.shape[0]
    a, b = a.reshape(a.shape[0], heads), b.reshape(b.shape[0], heads)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def gated_delta_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 [T, H], beta [T, H] in b's dtype). a, b: [T, H], or [T, G, H / G] (value
    heads grouped by key head, as Qwen3-Next's projection leaves them), each with unit
    stride in its last dimension; A_log, dt_bias: [H]."""
    heads = A_log.shape[0]
    for name, x in (("a", a), ("b", b)):
        if x.shape[0] != a.shape[0] or x.shape[1:].numel() != heads or x.dim() not in (2, 3):
            raise ValueError(
                f"gated_delta_gates: {name} has shape {tuple(x.shape)}; expected "
                f"[{a.shape[0]}, {heads}] or [{a.shape[0]}, G, {heads} / G]"
            )
    return dispatch(GATED_DELTA_GATES_OP, a.device)(a, b, A_log, dt_bias)
