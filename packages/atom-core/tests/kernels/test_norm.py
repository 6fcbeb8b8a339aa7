"""RMSNorm references against HF's norms (the same op order, so results are exact):
LlamaRMSNorm, and Qwen3-Next's zero-centred and gated norms."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
)

from atom.kernels import fused_add_rms_norm, gated_rms_norm, rms_norm, zero_centred_rms_norm


def hf_norm(hidden: int, dtype: torch.dtype) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 128)])
def test_rms_norm_equals_hf(dtype, shape):
    norm = hf_norm(shape[-1], dtype)
    x = torch.randn(shape, dtype=dtype) * 4
    got = rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_equals_add_then_hf(dtype):
    norm = hf_norm(64, dtype)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(new_residual, x + residual) and new_residual.dtype == dtype
    assert torch.equal(normed, norm(x + residual))
    # The reference is functional: callers own their buffers.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_bf16_is_close_to_fp32():
    weight = torch.randn(256)
    x = torch.randn(9, 256)
    low = rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6).float()
    # bf16 keeps 8 significant bits: inputs, the normalised value and the product are each
    # rounded once (relative error 2^-9 each), so about 3 * 2^-9 < 1e-2 relative in all.
    torch.testing.assert_close(low, rms_norm(x, weight, 1e-6), rtol=1e-2, atol=1e-2)


def test_rms_norm_uses_eps():
    zeros = torch.zeros(2, 16)
    # With x = 0 only eps keeps the rsqrt finite.
    assert torch.equal(rms_norm(zeros, torch.ones(16), 1e-6), zeros)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_equals_hf(dtype):
    norm = Qwen3NextRMSNorm(96, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight, std=0.1)
    x, residual = torch.randn(2, 5, 96, dtype=dtype) * 4, torch.randn(2, 5, 96, dtype=dtype)
    assert torch.equal(zero_centred_rms_norm(x, norm.weight, 1e-6), norm(x))
    normed, new_residual = zero_centred_rms_norm(x, norm.weight, 1e-6, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_hf(dtype):
    norm = Qwen3NextRMSNormGated(64, eps=1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x, gate = torch.randn(7, 3, 64, dtype=dtype), torch.randn(7, 3, 64, dtype=dtype)
    got = gated_rms_norm(x, gate, norm.weight, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, norm(x, gate))
