"""SiLU-and-mul against HF's `act_fn(gate) * up` (same dtype, so results are exact)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from atom.kernels import silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 128)])
def test_silu_and_mul_equals_hf_mlp_activation(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    d = shape[-1] // 2
    got = silu_and_mul(x)
    assert got.shape == (*shape[:-1], d) and got.dtype == dtype
    assert torch.equal(got, ACT2FN["silu"](x[..., :d]) * x[..., d:])


def test_silu_and_mul_formula():
    gate, up = torch.tensor([[0.0, 1.0, -2.0]]), torch.tensor([[3.0, 2.0, 5.0]])
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], -1)), want)


def test_clamped_silu_is_deepseek_v4s_expert_activation():
    from atom.kernels.activation import clamped_silu

    x = torch.randn(5, 16) * 20  # most values past the limit
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)
    torch.testing.assert_close(clamped_silu(10.0)(x), want)
