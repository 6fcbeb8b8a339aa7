"""Gated DeltaNet's gates in one kernel (atom.kernels.gated_delta_gates): a block of tokens
per program, every value head in it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.gated_delta_gates import GATED_DELTA_GATES_OP
from atom.kernels.policy import capturable, register

# softplus(x) = x above it, as torch's (beta 1, threshold 20).
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def _log1p(y):
    # log(1 + y), corrected for the rounding of 1 + y (exact to an ulp for small y).
    u = 1.0 + y
    return tl.log(u) - ((u - 1.0) - y) / u


@triton.jit
def _gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    num_tokens, per_group, a_stride_t, a_stride_g, b_stride_t, b_stride_g,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    mask = (tokens < num_tokens)[:, None] & head_ok[None, :]
    group, within = heads // per_group, heads % per_group
    rows = tokens[:, None].to(tl.int64)
    a = tl.load(a_ptr + rows * a_stride_t + (group * a_stride_g + within)[None, :], mask=mask)
    b = tl.load(b_ptr + rows * b_stride_t + (group * b_stride_g + within)[None, :], mask=mask)
    x = a.to(tl.float32) + tl.load(dt_bias_ptr + heads, mask=head_ok).to(tl.float32)[None, :]
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, _log1p(tl.exp(x)))
    decay = -tl.exp(tl.load(a_log_ptr + heads, mask=head_ok).to(tl.float32))
    out = rows * HEADS + heads[None, :]
    tl.store(g_ptr + out, decay[None, :] * softplus, mask=mask)
    beta = tl.sigmoid(b.to(tl.float32))
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def _grouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    x = x if x.dim() == 3 else x.view(x.shape[0], 1, heads)
    if x.stride(-1) != 1:
        raise ValueError("gated_delta_gates: a and b need unit stride in their last dimension")
    return x


@register(GATED_DELTA_GATES_OP, "triton")
@capturable
def gated_delta_gates(a, b, A_log, dt_bias):
    heads, num_tokens = A_log.shape[0], a.shape[0]
    a, b = _grouped(a, heads), _grouped(b, heads)
    g = torch.empty(num_tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, heads, dtype=b.dtype, device=a.device)
    if num_tokens == 0:
        return g, beta
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, min(64, 4096 // block_h))
    _gates_kernel[(triton.cdiv(num_tokens, block_t),)](
        a, b, A_log, dt_bias, g, beta,
        num_tokens, a.shape[2], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        HEADS=heads, BLOCK_H=block_h, BLOCK_T=block_t,
    )  # fmt: skip
    return g, beta
