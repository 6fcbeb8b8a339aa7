"""Short causal depthwise convolution over a varlen batch (Gated DeltaNet's q/k/v
channels) with each sequence's last K-1 inputs kept in a per-request pool.

Output token t of a sequence is act(bias + sum_j weight[:, j] * x[t - (K-1) + j]), where
inputs before the sequence's first new token come from its conv state (or are zeros
when it has none). The Triton kernel (atom/kernels/triton/causal_conv1d.py) registers
under the same op name and signature; the kernel policy picks it on GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom.kernels.gated_delta import padded_rows
from atom.kernels.policy import dispatch, register

CAUSAL_CONV1D_OP = "causal_conv1d"
ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


@register(CAUSAL_CONV1D_OP, "torch")
def causal_conv1d_torch(
    x, weight, bias, conv_state, state_slots, query_start_loc, has_initial_state, activation
):
    channels, width = weight.shape
    index, valid = padded_rows(query_start_loc.tolist())
    index, valid = index.to(x.device), valid.to(x.device)
    slots = state_slots.long()
    keep = has_initial_state.to(conv_state.device)[:, None, None]
    history = torch.where(keep, conv_state[slots], torch.zeros((), dtype=conv_state.dtype))
    new = x[index].masked_fill(~valid[..., None], 0).transpose(1, 2)  # [B, C, L]
    inputs = torch.cat([history.to(x.dtype), new], dim=-1)  # [B, C, K-1+L]
    y = F.conv1d(inputs.float(), weight.float()[:, None, :], None, groups=channels)
    if bias is not None:
        y = y + bias.float()[:, None]
    y = ACTIVATIONS[activation](y).transpose(1, 2)  # [B, L, C]
    out = torch.zeros_like(x)
    out[index[valid]] = y[valid].to(x.dtype)
    # The last K-1 inputs of each sequence: history and new tokens together.
    lengths = valid.sum(1)
    tail = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]
    conv_state[slots] = torch.gather(inputs, 2, tail[:, None, :].expand(-1, channels, -1)).to(
        conv_state.dtype
    )
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """y [T, C] in x's dtype (fp32 arithmetic).

    x [T, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1] pool, updated in
    place so that conv_state[slot] holds the sequence's last K-1 inputs; state_slots [B]
    int32; query_start_loc [B+1] int32; has_initial_state [B] bool (False: the inputs
    before the first token are zeros). Tokens past query_start_loc[B] are left zero.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"causal_conv1d activation={activation!r} is not supported; use one of "
            f"{sorted(a for a in ACTIVATIONS if a)} or None"
        )
    return dispatch(CAUSAL_CONV1D_OP, x.device)(
        x, weight, bias, conv_state, state_slots, query_start_loc, has_initial_state, activation
    )
