"""Gated DeltaNet's gates in one Triton kernel against the torch reference (fp64 here):
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), with a and b read where
Qwen3-Next's projection leaves them (grouped by key head, strided) or as plain [T, H],
and inputs from far below to far above softplus's threshold. On CPU under Triton's
interpreter (TRITON_INTERPRET=1; skipped otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.gated_delta_gates import gated_delta_gates  # noqa: E402


def reference(a, b, A_log, dt_bias):
    a = a.reshape(a.shape[0], A_log.shape[0]).double()
    b = b.reshape(b.shape[0], A_log.shape[0]).double()
    return -A_log.double().exp() * F.softplus(a + dt_bias.double()), b.sigmoid()


def projection(num_tokens, key_heads, per_key, dtype, spread, seed=0):
    """b and a as views of one [T, Hk, 2 * per_key] projection output, as Qwen3-Next's."""
    generator = torch.Generator().manual_seed(seed)
    ba = torch.randn(num_tokens, key_heads, 2 * per_key, generator=generator) * spread
    b, a = ba.to(DEVICE, dtype).split(per_key, dim=-1)
    heads = key_heads * per_key
    A_log = torch.randn(heads, generator=generator).to(DEVICE)
    dt_bias = torch.randn(heads, generator=generator).to(DEVICE, dtype)
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "key_heads", "per_key"), [(0, 4, 2), (1, 4, 2), (37, 2, 3), (130, 16, 2)]
)
def test_gates_of_grouped_projections_match_the_reference(num_tokens, key_heads, per_key, dtype):
    a, b, A_log, dt_bias = projection(num_tokens, key_heads, per_key, dtype, spread=12.0)
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    want_g, want_beta = reference(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert g.shape == beta.shape == (num_tokens, key_heads * per_key)
    # fp32 arithmetic on both sides; softplus of inputs down to e^-40 stays relative.
    torch.testing.assert_close(g.double(), want_g, rtol=2e-6, atol=1e-30)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(beta.double(), want_beta, rtol=tol, atol=tol)


def test_plain_inputs_and_the_layers_reference_agree():
    """[T, H] inputs (Qwen3.5's projections) give what the torch op gives."""
    from atom.kernels.gated_delta_gates import gated_delta_gates_torch

    a, b, A_log, dt_bias = projection(9, 1, 8, torch.float32, spread=3.0, seed=1)
    a, b = a.reshape(9, 8).contiguous(), b.reshape(9, 8).contiguous()
    for got, want in zip(gated_delta_gates(a, b, A_log, dt_bias),
                         gated_delta_gates_torch(a, b, A_log, dt_bias)):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


def test_inputs_that_are_not_unit_strided_are_refused():
    a, b, A_log, dt_bias = projection(4, 2, 2, torch.float32, spread=1.0)
    with pytest.raises(ValueError, match="unit stride"):
        gated_delta_gates(a.transpose(1, 2), b.transpose(1, 2), A_log, dt_bias)
