"""FP8 (e4m3) quantization and scaled GEMM against naive per-group loops and fp64 matmuls.

Error bounds come from the format: e4m3 keeps 3 mantissa bits, so rounding a normal value
(|v| >= 2^-6) to nearest is off by at most half a unit in the last place, 2^-4 relative;
subnormals are spaced 2^-9 apart, so their error is at most 2^-10 absolute. In the
scaled domain (real = fp8 * s) that is |dequant(quant(x)) - x| <= 2^-4 |x| + 2^-10 s.
"""

from __future__ import annotations

import pytest
import torch

from atom.kernels import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_scaled_mm,
    quantize_fp8_per_block,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
)

E4M3_MAX = 448.0
SLACK = 1 + 1e-5  # fp32 division and multiplication around the fp8 rounding


def e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (2**-4 * x.abs() + 2**-10 * scale) * SLACK


def assert_round_trip(x, q, scale_per_element):
    assert q.dtype == FP8_DTYPE
    error = (q.float() * scale_per_element - x).abs()
    assert (error <= e4m3_bound(x, scale_per_element)).all()


def naive_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One group: scale = amax / 448, values rounded to e4m3."""
    scale = x.abs().max().float() / E4M3_MAX
    return (x.float() / scale).to(FP8_DTYPE), scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fp8_dtype():
    assert FP8_DTYPE is torch.float8_e4m3fn and torch.finfo(FP8_DTYPE).max == E4M3_MAX


def test_per_tensor_dynamic_and_static_scale():
    x = torch.randn(16, 200) * 3
    q, scale = quantize_fp8_per_tensor(x)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(x.abs().max().item() / E4M3_MAX)
    assert q.float().abs().max().item() == E4M3_MAX  # the largest value maps to the top
    assert_round_trip(x, q, scale)

    # A static scale that is too small saturates at +-448 instead of overflowing to NaN.
    static = torch.tensor([x.abs().max().item() / E4M3_MAX / 2])
    q, scale = quantize_fp8_per_tensor(x, static)
    assert torch.equal(scale, static) and not q.float().isnan().any()
    assert q.float().abs().max().item() == E4M3_MAX


def test_per_token_scales_each_row():
    x = torch.randn(12, 200) * torch.logspace(-3, 3, 12)[:, None]
    q, scale = quantize_fp8_per_token(x)
    assert scale.shape == (12, 1)
    for row in range(12):
        want_q, want_scale = naive_quantize(x[row])
        assert scale[row, 0] == want_scale and same_bits(q[row], want_q)
    assert_round_trip(x, q, scale)


@pytest.mark.parametrize("k, group_size", [(256, 128), (200, 128), (96, 128), (100, 32)])
def test_per_token_group_matches_loop(k, group_size):
    x = torch.randn(5, k) * 4
    q, scale = quantize_fp8_per_token_group(x, group_size)
    assert q.shape == x.shape and scale.shape == (5, -(-k // group_size))
    for row in range(5):
        for g in range(scale.shape[1]):
            cols = slice(g * group_size, (g + 1) * group_size)
            want_q, want_scale = naive_quantize(x[row, cols])
            assert scale[row, g] == want_scale and same_bits(q[row, cols], want_q)
    scale_per_element = scale[:, torch.arange(k) // group_size]
    assert_round_trip(x, q, scale_per_element)
    dequantized = dequantize_fp8(q, scale, (1, group_size))
    assert torch.equal(dequantized, q.float() * scale_per_element)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (64, 100)])
def test_per_block_matches_loop(shape):
    w = torch.randn(shape)
    w[:128, :128] *= 100  # tiles differ in range; each gets its own scale
    q, scale = quantize_fp8_per_block(w)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            want_q, want_scale = naive_quantize(w[rows, cols])
            assert scale[i, j] == want_scale and same_bits(q[rows, cols], want_q)
    scale_per_element = scale[torch.arange(shape[0]) // 128][:, torch.arange(shape[1]) // 128]
    assert_round_trip(w, q, scale_per_element)
    assert torch.equal(dequantize_fp8(q, scale, (128, 128)), q.float() * scale_per_element)


def test_non_square_blocks():
    w = torch.randn(100, 70)
    q, scale = quantize_fp8_per_block(w, (64, 32))
    assert scale.shape == (2, 3)
    scale_per_element = scale[torch.arange(100) // 64][:, torch.arange(70) // 32]
    assert torch.equal(dequantize_fp8(q, scale, (64, 32)), q.float() * scale_per_element)


def test_zero_inputs_get_a_positive_scale():
    zeros = torch.zeros(4, 130)
    for q, scale in (
        quantize_fp8_per_tensor(zeros),
        quantize_fp8_per_token(zeros),
        quantize_fp8_per_token_group(zeros),
        quantize_fp8_per_block(zeros),
    ):
        assert (scale > 0).all() and torch.isfinite(scale).all()
        assert not q.float().any()


@pytest.mark.parametrize("scale", [torch.tensor(0.5), torch.tensor([0.5])])
def test_dequantize_scalar_scale_and_dtype(scale):
    q, _ = quantize_fp8_per_tensor(torch.randn(6, 10))
    assert torch.equal(dequantize_fp8(q, scale), q.float() * 0.5)
    low = dequantize_fp8(q, scale, dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, (q.float() * 0.5).bfloat16())


def test_dequantize_per_row_scale():
    q, scale = quantize_fp8_per_token(torch.randn(6, 10))
    assert torch.equal(dequantize_fp8(q, scale), q.float() * scale)


def quantized_operands(mode: str, m: int, n: int, k: int):
    """(a, b, a_q, a_scale, b_q, b_scale, block_size, a_scale_per_element, b_scale_per_element)."""
    a, b = torch.randn(m, k), torch.randn(n, k) * 0.1
    cols = torch.arange(k)
    if mode == "group-block":
        a_q, a_s = quantize_fp8_per_token_group(a, 128)
        b_q, b_s = quantize_fp8_per_block(b)
        a_full = a_s[:, cols // 128]
        b_full = b_s[torch.arange(n) // 128][:, cols // 128]
        return a, b, a_q, a_s, b_q, b_s, (128, 128), a_full, b_full
    a_q, a_s = quantize_fp8_per_token(a) if mode == "token-channel" else quantize_fp8_per_tensor(a)
    b_q, b_s = quantize_fp8_per_tensor(b) if mode == "tensor-tensor" else quantize_fp8_per_token(b)
    return a, b, a_q, a_s, b_q, b_s, None, a_s.expand(m, k), b_s.expand(n, k)


MM_MODES = ["tensor-tensor", "tensor-channel", "token-channel", "group-block"]


@pytest.mark.parametrize("mode", MM_MODES)
@pytest.mark.parametrize("m, n, k", [(9, 130, 256), (3, 200, 200), (1, 64, 96)])
def test_scaled_mm_equals_dequantized_matmul(mode, m, n, k):
    _, _, a_q, a_s, b_q, b_s, block, a_full, b_full = quantized_operands(mode, m, n, k)
    bias = torch.randn(n)
    got = fp8_scaled_mm(a_q, a_s, b_q, b_s, torch.float32, bias, block_size=block)
    want = (a_q.double() * a_full) @ (b_q.double() * b_full).T + bias.double()
    assert got.shape == (m, n) and got.dtype == torch.float32
    # fp32 accumulation over k products against fp64: a few ulps of the row's magnitude.
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", MM_MODES)
def test_scaled_mm_error_against_unquantized_operands(mode):
    a, b, a_q, a_s, b_q, b_s, block, a_full, b_full = quantized_operands(mode, 9, 130, 200)
    got = fp8_scaled_mm(a_q, a_s, b_q, b_s, torch.float32, block_size=block)
    # Each operand is within its e4m3 bound e, so |a'b' - ab| <= |a| e_b + e_a |b| + e_a e_b.
    err_a, err_b = e4m3_bound(a, a_full), e4m3_bound(b, b_full)
    bound = a.abs() @ err_b.T + err_a @ b.abs().T + err_a @ err_b.T
    assert ((got - a @ b.T).abs() <= bound + 1e-4).all()


def test_scaled_mm_bf16_output_is_the_rounded_fp32_result():
    _, _, a_q, a_s, b_q, b_s, block, _, _ = quantized_operands("group-block", 9, 130, 200)
    bias = torch.randn(130)
    high = fp8_scaled_mm(a_q, a_s, b_q, b_s, torch.float32, bias, block_size=block)
    low = fp8_scaled_mm(a_q, a_s, b_q, b_s, torch.bfloat16, bias.bfloat16(), block_size=block)
    # One rounding to bf16 (relative 2^-9) plus the bias rounded to bf16 before the add.
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), high, atol=1e-2, rtol=2**-8)
