"""The Triton W4A16 GEMM against the torch reference (atom.kernels.w4a16).

Small shapes run on CPU under TRITON_INTERPRET=1; Qwen3-8B's shapes (bf16, batch 1 and
16) run on a CUDA device only.
"""

from __future__ import annotations

import pytest
import torch

from atom.kernels.w4a16 import pack_int4_rows, w4a16_gemm_torch
from atom.testing.triton_device import triton_test_device

triton = pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.w4a16 import w4a16_gemm_triton  # noqa: E402

ON_GPU = DEVICE == "cuda"
# (K, N): whole groups, N not a multiple of the tile, K not a multiple of the K step.
SMALL = [(256, 96), (128, 200), (96, 64)]
# Qwen3-8B: (hidden -> hidden), (hidden -> q/k/v... up to 3 * hidden), (intermediate -> hidden).
QWEN3_8B = [(4096, 4096), (4096, 12288), (12288, 4096)]


def operands(m, k, n, group_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).float()
    scales = torch.rand(groups, n, generator=gen) / k**0.5
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    tensors = (x, pack_int4_rows(codes), scales, zeros)
    return [t.to(DEVICE) for t in tensors], bias.to(DEVICE)


def check(m, k, n, group_size, dtype, with_bias):
    (x, qweight, scales, zeros), bias = operands(m, k, n, group_size, dtype)
    bias = bias if with_bias else None
    got = w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bias)
    want = w4a16_gemm_torch(x, qweight, scales, zeros, group_size, bias)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # same bf16 weights, fp32 sums in another order, one bf16 rounding of the output
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("k, n", SMALL)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_small_shapes(m, k, n, group_size, with_bias):
    if group_size != -1 and k % group_size:
        pytest.skip("the group must divide K")
    check(m, k, n, k if group_size == -1 else group_size, torch.float32, with_bias)


@pytest.mark.skipif(not ON_GPU, reason="Triton 3.9's interpreter mis-computes tl.dot on bf16")
def test_bfloat16_small():
    check(7, 256, 64, 64, torch.bfloat16, with_bias=True)


@pytest.mark.skipif(not ON_GPU, reason="Qwen3-8B shapes run on a CUDA device")
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("k, n", QWEN3_8B)
@pytest.mark.parametrize("m", [1, 16])
def test_qwen3_8b_shapes_bf16(m, k, n, group_size):
    check(m, k, n, k if group_size == -1 else group_size, torch.bfloat16, with_bias=False)
