"""SiLU(gate) * up over rows of [gate | up]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.policy import register


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    # silu in fp32, rounded to the input dtype before the product (as torch's F.silu * up).
    silu = (gate.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, silu * up, mask=mask)


@register("silu_and_mul", "triton")
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2d = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty(x2d.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2d.shape[0], triton.cdiv(d, block))](
        x2d, out, x2d.stride(0), out.stride(0), d, BLOCK=block
    )
    return out.view(*x.shape[:-1], d)
