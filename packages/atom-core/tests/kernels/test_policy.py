"""KernelPolicy: the torch reference on CPU, ATOM_KERNELS overrides, errors that name the problem."""

from __future__ import annotations

import pytest
import torch

# Importing the package registers every op's torch reference.
from atom.kernels import policy, silu_and_mul

REFERENCE_OPS = [
    "apply_rotary_emb",
    "fp8_scaled_mm",
    "fused_add_rms_norm",
    "paged_attention",
    "quantize_fp8_per_token_group",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]


@pytest.fixture
def fake_registry(monkeypatch):
    """A private registry with one op in triton and torch, on a device that runs Triton."""
    registry: dict = {}
    monkeypatch.setattr(policy, "_IMPLS", registry)
    monkeypatch.setattr(
        policy, "_device_backends", lambda device_type: ("triton", "torch")
        if device_type == "cuda" else ("torch",)
    )  # fmt: skip
    policy._select.cache_clear()
    policy.register("double", "triton")(lambda x: ("triton", x))
    policy.register("double", "torch")(lambda x: ("torch", x))
    yield registry
    policy._select.cache_clear()


@pytest.mark.parametrize("op", REFERENCE_OPS)
def test_cpu_dispatches_every_reference_op_to_torch(op, monkeypatch):
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    assert "torch" in policy.registered_ops()[op]
    assert policy.selected_backend(op, "cpu") == "torch"


@pytest.mark.parametrize("forced", ["torch", "triton", "aiter", " Triton "])
def test_cpu_stays_on_torch_whatever_is_forced(forced, monkeypatch):
    monkeypatch.setenv("ATOM_KERNELS", forced)
    assert policy.selected_backend("rms_norm", "cpu") == "torch"


def test_gpu_prefers_triton_and_the_override_forces_torch(fake_registry, monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    assert policy.dispatch("double", cuda)(2) == ("triton", 2)
    monkeypatch.setenv("ATOM_KERNELS", "torch")
    assert policy.dispatch("double", cuda)(2) == ("torch", 2)
    monkeypatch.setenv("ATOM_KERNELS", "TRITON")
    assert policy.selected_backend("double", "cuda") == "triton"
    # A backend that does not provide the op falls back to the reference.
    monkeypatch.setenv("ATOM_KERNELS", "aiter")
    assert policy.selected_backend("double", "cuda") == "torch"
    monkeypatch.setenv("ATOM_KERNELS", "")
    assert policy.selected_backend("double", "cuda") == "triton"


def test_capturable_up_to_a_number_of_query_tokens(fake_registry, monkeypatch):
    """An implementation capturable only in steps of few tokens per sequence (the Triton
    gated delta rule: one chunk each) is capturable for a decode and a short verify step,
    not for longer ones; the torch reference never is."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("ATOM_KERNELS", raising=False)
    policy.register("bounded", "triton")(policy.capturable_up_to(8)(lambda: None))
    policy.register("bounded", "torch")(lambda: None)
    assert [policy.is_capturable("bounded", cuda, n) for n in (1, 8, 9)] == [True, True, False]
    assert policy.is_capturable("double", cuda) is False
    monkeypatch.setenv("ATOM_KERNELS", "torch")
    assert not policy.is_capturable("bounded", cuda)


def test_bad_override_is_an_error_naming_the_value(monkeypatch):
    monkeypatch.setenv("ATOM_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="ATOM_KERNELS='cuda-magic'"):
        policy.dispatch("rms_norm", torch.device("cpu"))


def test_unknown_op_and_unknown_backend_are_errors(fake_registry):
    with pytest.raises(KeyError, match="no kernel registered for op 'nope'"):
        policy.dispatch("nope", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown kernel backend 'cutlass'"):
        policy.register("double", "cutlass")
    policy.register("triton_only", "triton")(lambda: None)
    with pytest.raises(KeyError, match="no implementation for device 'cpu'"):
        policy.dispatch("triton_only", torch.device("cpu"))


def test_public_functions_run_through_dispatch(fake_registry):
    """A backend registered later under the same op name replaces the reference."""
    policy.register("silu_and_mul", "torch")(lambda x: "dispatched")
    assert silu_and_mul(torch.zeros(2, 4)) == "dispatched"
