"""The aiter adapters: never loaded without ROCm + aiter, and equal to the torch references
where they are (those tests skip elsewhere, with the reason)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

# Importing the package registers every op's torch reference.
from atom.kernels import fused_add_rms_norm, policy, rms_norm
from atom.kernels.activation import silu_and_mul_torch
from atom.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_scaled_mm_torch,
    quantize_fp8_per_block,
    quantize_fp8_per_token_group_torch,
)
from atom.kernels.moe import topk_softmax_torch
from atom.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch

HAVE_ROCM_AITER = (
    torch.version.hip is not None
    and torch.cuda.is_available()
    and importlib.util.find_spec("aiter") is not None
)
rocm_aiter = pytest.mark.skipif(
    not HAVE_ROCM_AITER, reason="needs a ROCm build of torch, an AMD GPU and aiter installed"
)
TOL = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def fake_registry(monkeypatch):
    """A private registry with one op in every backend, on a device that offers all three."""
    monkeypatch.setattr(policy, "_IMPLS", {})
    monkeypatch.setattr(
        policy, "_device_backends", lambda device_type: ("aiter", "triton", "torch")
        if device_type == "cuda" else ("torch",)
    )  # fmt: skip
    policy._select.cache_clear()
    for backend in policy.BACKENDS:
        policy.register("double", backend)(lambda x, backend=backend: (backend, x))
    yield
    policy._select.cache_clear()


# --- everywhere: the policy side -------------------------------------------------------


@pytest.mark.skipif(HAVE_ROCM_AITER, reason="checks a machine without ROCm + aiter")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_without_rocm_aiter_nothing_routes_to_aiter(device, monkeypatch):
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    for op in policy.registered_ops():
        assert policy.selected_backend(op, device) != "aiter"
    assert "atom.kernels.aiter" not in sys.modules
    assert not any("aiter" in backends for backends in policy.registered_ops().values())


def test_forcing_aiter_on_cpu_runs_the_torch_reference(monkeypatch):
    monkeypatch.setenv("ATOM_KERNELS", "aiter")
    x, residual, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    assert policy.selected_backend("rms_norm", "cpu") == "torch"
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), rtol=0, atol=0)
    got = fused_add_rms_norm(x, residual, w, 1e-6)
    for a, b in zip(got, fused_add_rms_norm_torch(x, residual, w, 1e-6)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_declining_adapter_hands_on_to_the_next_backend(fake_registry, monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    assert policy.dispatch("double", cuda)(1) == ("aiter", 1)
    assert policy.fallback("double", cuda, "aiter")(1) == ("triton", 1)
    # Forcing aiter leaves only the reference behind it.
    monkeypatch.setenv("ATOM_KERNELS", "aiter")
    assert policy.fallback("double", cuda, "aiter")(1) == ("torch", 1)


# --- ROCm + aiter: every adapter against its reference ---------------------------------


@rocm_aiter
def test_rocm_dispatches_the_adapted_ops_to_aiter(monkeypatch):
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "topk_softmax"):
        assert policy.selected_backend(op, "cuda") == "aiter"


@rocm_aiter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 128), (37, 2048), (3, 11, 4096), (64, 5120)])
def test_rms_norm(dtype, shape):
    from atom.kernels.aiter import norm

    x = torch.randn(shape, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    w = torch.randn(shape[-1], device="cuda", dtype=dtype)
    torch.testing.assert_close(
        norm.rms_norm_aiter(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), **TOL[dtype]
    )
    x_before, residual_before = x.clone(), residual.clone()
    got = norm.fused_add_rms_norm_aiter(x, residual, w, 1e-6)
    for a, b in zip(got, fused_add_rms_norm_torch(x, residual, w, 1e-6)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@rocm_aiter
def test_rms_norm_hands_fp32_on():
    from atom.kernels.aiter import norm

    x, w = torch.randn(9, 256, device="cuda"), torch.randn(256, device="cuda")
    torch.testing.assert_close(norm.rms_norm_aiter(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))


@rocm_aiter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", [(1, 256), (29, 3072), (4, 7, 1536), (128, 2 * 14336)])
def test_silu_and_mul(dtype, shape):
    from atom.kernels.aiter import activation

    x = torch.randn(shape, device="cuda", dtype=dtype)
    torch.testing.assert_close(
        activation.silu_and_mul_aiter(x), silu_and_mul_torch(x), **TOL[dtype]
    )


def _by_expert(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.argsort(dim=-1)
    return weights.gather(-1, order), ids.gather(-1, order)


@rocm_aiter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (64, 6), (128, 8), (256, 8), (60, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 33, 512])
def test_topk_softmax(dtype, num_experts, top_k, renormalize, num_tokens):
    from atom.kernels.aiter import moe_routing

    logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=dtype)
    weights, ids = moe_routing.topk_softmax_aiter(logits, top_k, renormalize)
    ref_weights, ref_ids = topk_softmax_torch(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    weights, ids = _by_expert(weights, ids)
    ref_weights, ref_ids = _by_expert(ref_weights, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-4)


@rocm_aiter
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,k", [(1, 128), (17, 512), (256, 7168)])
def test_quantize_fp8_per_token_group(dtype, m, k):
    from atom.kernels.aiter import fp8

    x = torch.randn(m, k, device="cuda", dtype=dtype) * 4
    x[0, :128] = 0  # an all-zero group must dequantize to zeros, not NaN
    q, scale = fp8.quantize_fp8_per_token_group_aiter(x, 128)
    ref_q, ref_scale = quantize_fp8_per_token_group_torch(x, 128)
    assert q.shape == ref_q.shape and scale.shape == ref_scale.shape
    nonzero = ref_scale > 1e-6
    torch.testing.assert_close(scale[nonzero], ref_scale[nonzero], rtol=1e-5, atol=0)
    dequant = dequantize_fp8(q, scale, (1, 128))
    torch.testing.assert_close(dequant, dequantize_fp8(ref_q, ref_scale, (1, 128)), **TOL[dtype])
    assert torch.isfinite(dequant).all()


@rocm_aiter
@pytest.mark.parametrize("out_dtype", HALF)
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (33, 1536, 7168), (256, 7168, 2048)])
def test_fp8_block_scaled_mm(out_dtype, m, n, k):
    from atom.kernels.aiter import fp8

    a_q, a_scale = quantize_fp8_per_token_group_torch(torch.randn(m, k, device="cuda"), 128)
    b_q, b_scale = quantize_fp8_per_block(torch.randn(n, k, device="cuda") / k**0.5)
    assert a_q.dtype == FP8_DTYPE
    args = (a_q, a_scale, b_q, b_scale, out_dtype, None, (128, 128))
    torch.testing.assert_close(
        fp8.fp8_scaled_mm_aiter(*args), fp8_scaled_mm_torch(*args), atol=3e-2, rtol=2e-2
    )
