"""Triton FP8 kernels (per-token-group quantization, scaled GEMM) against the torch references.

Runs on a CUDA device; on CPU only under Triton's interpreter (TRITON_INTERPRET=1), which
rounds to e4m3 differently from the hardware: there the quantizer's fp8 values are left
to the GPU run, while its scales and the GEMM (fp8 inputs from torch) are checked.
"""

from __future__ import annotations

import pytest
import torch

from atom.kernels.fp8 import (
    fp8_scaled_mm_torch,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group_torch,
)
from atom.kernels.policy import selected_backend
from atom.testing.triton_device import triton_test_device

triton = pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.fp8 import (  # noqa: E402
    fp8_scaled_mm_triton,
    quantize_fp8_per_token_group_triton,
)

ON_GPU = DEVICE == "cuda"
ROWS = [1, 7, 64, 300] if ON_GPU else [1, 7, 40]
# (N, K): multiples of the 128x128 block, ragged edges, and Qwen3-30B-A3B / DeepSeek shapes.
SHAPES = [(256, 512), (200, 320)] + ([(1536, 2048), (7168, 2304)] if ON_GPU else [])
OUT_DTYPE = torch.bfloat16 if ON_GPU else torch.float32


@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("cols", [128, 200, 512, 7168])
@pytest.mark.parametrize("rows", ROWS)
def test_quantize_per_token_group(rows, cols, group_size):
    x = torch.randn(rows, cols, device=DEVICE) * torch.logspace(-3, 2, cols, device=DEVICE)
    x[0, :group_size] = 0  # an all-zero group keeps a finite scale
    q, scale = quantize_fp8_per_token_group_triton(x, group_size)
    want_q, want_scale = quantize_fp8_per_token_group_torch(x, group_size)
    assert q.dtype == want_q.dtype and q.shape == want_q.shape
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=0)
    if ON_GPU:  # same division and the same round-to-nearest-even conversion
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_per_token_group_bf16_input():
    if not ON_GPU:
        pytest.skip("bf16 is checked on the GPU")
    x = torch.randn(33, 1024, device=DEVICE, dtype=torch.bfloat16)
    q, scale = quantize_fp8_per_token_group_triton(x, 128)
    want_q, want_scale = quantize_fp8_per_token_group_torch(x, 128)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def assert_matmul_close(got, want):
    assert got.dtype == want.dtype
    tol = dict(atol=2e-2, rtol=2e-2) if got.dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_scaled_mm_block(m, n, k, with_bias):
    """DeepSeek-V3 format: activation groups of 128, weight blocks of 128x128."""
    a_q, a_scale = quantize_fp8_per_token_group_torch(torch.randn(m, k, device=DEVICE), 128)
    b_q, b_scale = quantize_fp8_per_block(torch.randn(n, k, device=DEVICE) / k**0.5)
    bias = torch.randn(n, device=DEVICE) if with_bias else None
    args = (a_q, a_scale, b_q, b_scale, OUT_DTYPE, bias, (128, 128))
    assert_matmul_close(fp8_scaled_mm_triton(*args), fp8_scaled_mm_torch(*args))


@pytest.mark.parametrize("granularity", ["tensor", "token_channel"])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_scaled_mm_per_tensor_and_channel(m, n, k, granularity):
    a, b = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE) / k**0.5
    if granularity == "tensor":
        (a_q, a_scale), (b_q, b_scale) = quantize_fp8_per_tensor(a), quantize_fp8_per_tensor(b)
    else:
        (a_q, a_scale), (b_q, b_scale) = quantize_fp8_per_token(a), quantize_fp8_per_token(b)
    args = (a_q, a_scale, b_q, b_scale, OUT_DTYPE, None, None)
    assert_matmul_close(fp8_scaled_mm_triton(*args), fp8_scaled_mm_torch(*args))


@pytest.mark.gpu
def test_block_linear_dispatches_to_triton():
    """The FP8 block linear method reaches both kernels through the policy on CUDA."""
    assert selected_backend("quantize_fp8_per_token_group", "cuda") == "triton"
    assert selected_backend("fp8_scaled_mm", "cuda") == "triton"
