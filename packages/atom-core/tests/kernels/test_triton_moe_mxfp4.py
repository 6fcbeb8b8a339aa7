"""The Triton MXFP4 fused MoE against its torch reference (the experts dequantized, then
fused_moe_torch; tests/kernels/test_moe_mxfp4.py holds that against HF).

Runs on a CUDA device; on CPU only under Triton's interpreter (TRITON_INTERPRET=1, fp32
activations and small shapes), and is skipped otherwise. The gpt-oss-20b expert shapes
(hidden 2880, intermediate 2880, 32 experts, top-4, bf16) run on the GPU only.
"""

from __future__ import annotations

import pytest
import torch

from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.moe import topk_softmax_torch
from atom.kernels.moe_mxfp4 import fused_moe_mxfp4_torch
from atom.testing.mxfp4 import quantize_mxfp4
from atom.testing.triton_device import triton_test_device

triton = pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.fused_moe import GemmTiles, MoEConfig  # noqa: E402
from atom.kernels.triton.fused_moe_mxfp4 import fused_moe_mxfp4_triton  # noqa: E402

ON_GPU = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOKENS = [1, 7, 64, 300] if ON_GPU else [1, 7, 40]


def mxfp4_experts(num_experts, hidden, inter, biases: bool):
    """Packed w13 [E, 2I, H/32, 16] and w2 [E, H, I/32, 16] with their scales, and biases."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE) / inter**0.5
    (b13, s13), (b2, s2) = quantize_mxfp4(w13.cpu()), quantize_mxfp4(w2.cpu())
    packed = [t.to(DEVICE) for t in (b13, s13, b2, s2)]
    if not biases:
        return (*packed, None, None)
    return (*packed, torch.randn(num_experts, 2 * inter, device=DEVICE).to(DTYPE),
            torch.randn(num_experts, hidden, device=DEVICE).to(DTYPE))  # fmt: skip


def routed(num_tokens, num_experts, top_k, hidden):
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(DTYPE)
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    return x, *topk_softmax_torch(logits, top_k, True)


def run_both(num_tokens, num_experts, top_k, hidden, inter, activation, biases, config=None):
    b13, s13, b2, s2, bias13, bias2 = mxfp4_experts(num_experts, hidden, inter, biases)
    x, weights, ids = routed(num_tokens, num_experts, top_k, hidden)
    args = (x, b13, s13, b2, s2, weights, ids, activation, bias13, bias2)
    return fused_moe_mxfp4_triton(*args, config=config), fused_moe_mxfp4_torch(*args)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def assert_matches(got, want):
    assert got.dtype == want.dtype == DTYPE
    if ON_GPU:  # bf16 activations rounded between the GEMMs, in another order
        assert relative_error(got, want) < 1e-2
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


ACTIVATIONS = {"silu": "silu", "clamped-swiglu": ClampedSwiGLU(1.702, 0.75)}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_matches_reference(num_tokens, num_experts, top_k, activation):
    """GPT-OSS's form (biases, clamped SwiGLU with a limit that clamps many values) and the
    plain one, with the tiles pick_mxfp4_config gives."""
    biases = activation != "silu"
    got, want = run_both(num_tokens, num_experts, top_k, 64, 96, ACTIVATIONS[activation], biases)
    assert_matches(got, want)


# K tiles of one, two and four MXFP4 groups; N and K tails (hidden 160 = 5 groups, inter
# 96 = 3 groups are no multiples of the tiles); one tiling per GEMM.
CONFIGS = [
    MoEConfig.same(16, 32, 32),
    MoEConfig(32, GemmTiles(64, 64, group_m=4), GemmTiles(16, 128, group_m=2)),
    MoEConfig(64, GemmTiles(16, 128, group_m=3), GemmTiles(128, 64)),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_tile_configs(config):
    got, want = run_both(45, 8, 2, 160, 96, ACTIVATIONS["clamped-swiglu"], True, config)
    assert_matches(got, want)


def test_k_tile_of_partial_groups_is_rejected():
    with pytest.raises(ValueError, match="K tile 48 is not whole groups of 32"):
        run_both(3, 4, 2, 64, 32, "silu", False, MoEConfig.same(16, 32, 48))


def test_no_tokens():
    b13, s13, b2, s2, _, _ = mxfp4_experts(4, 64, 32, biases=False)
    x, weights, ids = routed(0, 4, 2, 64)
    out = fused_moe_mxfp4_triton(x, b13, s13, b2, s2, weights, ids, "silu")
    assert out.shape == (0, 64)


# gpt-oss-20b: hidden 2880, intermediate 2880 (90 groups each), 32 experts, top-4.
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_gpt_oss_20b_shapes(num_tokens):
    torch.manual_seed(0)
    got, want = run_both(num_tokens, 32, 4, 2880, 2880, ClampedSwiGLU(1.702, 7.0), True)
    assert_matches(got, want)


@pytest.mark.gpu
def test_replays_in_cuda_graph():
    b13, s13, b2, s2, bias13, bias2 = mxfp4_experts(32, 256, 128, biases=True)
    x, weights, ids = routed(24, 32, 4, 256)
    act = ClampedSwiGLU(1.702, 7.0)
    args = (x, b13, s13, b2, s2, weights, ids, act, bias13, bias2)
    fused_moe_mxfp4_triton(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_mxfp4_triton(*args)
    for _ in range(3):  # new inputs in the captured buffers route to other experts
        x.copy_(torch.randn_like(x))
        new_weights, new_ids = topk_softmax_torch(torch.randn(24, 32, device=DEVICE), 4, True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert_matches(out, fused_moe_mxfp4_torch(*args))
