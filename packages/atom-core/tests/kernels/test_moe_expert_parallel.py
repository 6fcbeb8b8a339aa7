"""Fused-MoE kernels under expert parallelism: each rank passes only its experts and the
routed ids made local (`ExpertPlacement.local_ids`: other ranks' experts become E_local),
and the ranks' outputs sum to the output of all experts on one rank.

The torch references run everywhere; the Triton kernels on a GPU or under
TRITON_INTERPRET=1 (skipped otherwise).
"""

from __future__ import annotations

import pytest
import torch

from atom.expert_parallel import ExpertPlacement
from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.moe import fused_moe_torch, topk_softmax_torch
from atom.kernels.moe_mxfp4 import fused_moe_mxfp4_torch
from atom.testing.mxfp4 import quantize_mxfp4

EXPERTS, TOP_K, HIDDEN, INTER, RANKS = 8, 3, 64, 64, 4


def triton_kernels():
    """(fused_moe, fused_moe_mxfp4) in Triton, and the device, or a skip."""
    pytest.importorskip("triton")
    from atom.testing.triton_device import triton_test_device

    device = triton_test_device()
    from atom.kernels.triton.fused_moe import fused_moe_triton
    from atom.kernels.triton.fused_moe_mxfp4 import fused_moe_mxfp4_triton

    return fused_moe_triton, fused_moe_mxfp4_triton, device


def routed(num_tokens: int, device: str):
    x = torch.randn(num_tokens, HIDDEN, device=device)
    weights, ids = topk_softmax_torch(torch.randn(num_tokens, EXPERTS, device=device), TOP_K, True)
    return x, weights, ids


def split_over_ranks(run, ids: torch.Tensor, experts: tuple) -> torch.Tensor:
    """Sum over ranks of run(the rank's slice of each per-expert tensor, its local ids)."""
    out = 0
    for rank in range(RANKS):
        placement = ExpertPlacement.of_rank(EXPERTS, rank, RANKS, "num_experts")
        local = placement.local_ids(ids)
        assert local.dtype == ids.dtype
        held = slice(placement.first, placement.first + placement.count)
        out = out + run(tuple(t[held] for t in experts), local)
    return out


def check_unquantized(kernel, device: str, num_tokens: int) -> None:
    """GPT-OSS's form: biases on both GEMMs (each added by the rank holding the expert)."""
    experts = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device) / HIDDEN**0.5,
        torch.randn(EXPERTS, HIDDEN, INTER, device=device) / INTER**0.5,
        torch.randn(EXPERTS, 2 * INTER, device=device),
        torch.randn(EXPERTS, HIDDEN, device=device),
    )
    x, weights, ids = routed(num_tokens, device)

    def run(experts, ids):
        w13, w2, b13, b2 = experts
        return kernel(
            x, w13, w2, weights, ids, ClampedSwiGLU(1.702, 7.0), None, None, None, b13, b2
        )

    torch.testing.assert_close(
        split_over_ranks(run, ids, experts), run(experts, ids), atol=1e-4, rtol=1e-4
    )


def check_mxfp4(kernel, device: str, num_tokens: int) -> None:
    (b13, s13), (b2, s2) = (
        quantize_mxfp4(torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5),
        quantize_mxfp4(torch.randn(EXPERTS, HIDDEN, INTER) / INTER**0.5),
    )
    experts = tuple(t.to(device) for t in (b13, s13, b2, s2))
    x, weights, ids = routed(num_tokens, device)

    def run(experts, ids):
        return kernel(x, *experts, weights, ids, "silu")

    torch.testing.assert_close(
        split_over_ranks(run, ids, experts), run(experts, ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_torch_references(num_tokens):
    check_unquantized(fused_moe_torch, "cpu", num_tokens)
    check_mxfp4(fused_moe_mxfp4_torch, "cpu", num_tokens)


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_triton_kernels(num_tokens, one_program, monkeypatch):
    fused_moe_triton, fused_moe_mxfp4_triton, device = triton_kernels()
    from atom.kernels.triton import moe_align

    if not one_program:  # the count / lay out / scatter launches of large batches
        monkeypatch.setattr(moe_align, "SINGLE_PROGRAM_ROWS", 0)
    check_unquantized(fused_moe_triton, device, num_tokens)
    check_mxfp4(fused_moe_mxfp4_triton, device, num_tokens)
