"""The W4A16 torch reference against naive per-element math on the packed layout."""

from __future__ import annotations

import pytest
import torch

from atom.kernels.w4a16 import pack_int4_rows, unpack_int4_rows, w4a16_gemm


def naive_weight(codes, zeros, scales, group_size):
    k, n = codes.shape
    w = torch.empty(k, n)
    for row in range(k):
        g = row // group_size
        w[row] = (codes[row].float() - zeros[g].float()) * scales[g].float()
    return w


def test_pack_puts_row_8i_plus_j_in_nibble_j():
    codes = torch.zeros(16, 2, dtype=torch.int32)
    codes[3, 0], codes[7, 0], codes[9, 1] = 5, 15, 1
    packed = pack_int4_rows(codes)
    assert packed.shape == (2, 2) and packed.dtype == torch.int32
    assert packed[0, 0].item() == (5 << 12) - (1 << 32) + (15 << 28)  # nibble 7 sets the sign bit
    assert packed[1, 1].item() == 1 << 4
    assert torch.equal(unpack_int4_rows(packed), codes)


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_naive_dequantized_matmul(group_size, with_bias):
    gen = torch.Generator().manual_seed(group_size)
    k, n, m = 256, 48, 5
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).float()
    scales = torch.rand(k // group_size, n, generator=gen) / 10
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = w4a16_gemm(x, pack_int4_rows(codes), scales, zeros, group_size, bias)
    want = x @ naive_weight(codes, zeros, scales, group_size)
    if with_bias:
        want = want + bias
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mismatched_shapes_name_the_operands():
    with pytest.raises(ValueError, match=r"w4a16_gemm: x \[.., 64\] does not fit qweight"):
        w4a16_gemm(
            torch.randn(2, 64), torch.zeros(4, 8, dtype=torch.int32), torch.ones(1, 8),
            torch.zeros(1, 8), 32,
        )  # fmt: skip
