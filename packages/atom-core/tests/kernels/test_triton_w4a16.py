"""The Triton W4A16 GEMM against the torch reference (atom.kernels.w4a16).

Small shapes run on CPU under TRITON_INTERPRET=1 (fp32 and fp16: the interpreter's bf16 dot
is wrong); Qwen3-8B's shapes (bf16, batch 1 and 16) and CUDA graphs run on a CUDA device
only. The small-M kernel (M <= 16) is checked at the defaults and, through the `config`
override, at every tile width, K split and warp count benchmarks/w4a16.py --sweep tries.
"""

from __future__ import annotations

import pytest
import torch

from atom.kernels.w4a16 import pack_int4_rows, w4a16_gemm_torch
from atom.testing.triton_device import triton_test_device

triton = pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.w4a16 import W4a16Config, w4a16_gemm_triton  # noqa: E402

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


def check(m, k, n, group_size, dtype, with_bias, config=None):
    (x, qweight, scales, zeros), bias = operands(m, k, n, group_size, dtype)
    bias = bias if with_bias else None
    got = w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bias, config=config)
    want = w4a16_gemm_torch(x, qweight, scales, zeros, group_size, bias)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # same 16-bit weights, fp32 sums in another order, one rounding of the output
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def small_m(block_n=64, split_k=1, num_warps=4, num_stages=3):
    return W4a16Config(16, block_n, 128, split_k, num_warps, num_stages)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("k, n", SMALL)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_small_shapes(m, k, n, group_size, with_bias):
    if group_size != -1 and k % group_size:
        pytest.skip("the group must divide K")
    check(m, k, n, k if group_size == -1 else group_size, torch.float32, with_bias)


# K = 640: five K steps of 128, so splits of 2 and 4 leave a shorter last split (3 + 2,
# 2 + 2 + 1); K = 320 ends in half a step. Group 128 does not divide 320.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("k", [640, 320])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_small_m_split_k(m, k, group_size, split_k, with_bias, dtype):
    if group_size != -1 and k % group_size:
        pytest.skip("the group must divide K")
    group_size = k if group_size == -1 else group_size
    check(m, k, 96, group_size, dtype, with_bias, config=small_m(split_k=split_k))


@pytest.mark.parametrize("m", [1, 16])
def test_split_inside_a_group(m):
    # K = 1280: ten K steps, four splits of three steps (384 rows): the splits start 1.5 and
    # 3 and 4.5 groups of 256 in. Each step reads its own group's scales, so none needs to
    # start on a group.
    check(m, 1280, 64, 256, torch.float32, with_bias=True, config=small_m(split_k=4))


# Every block_n, K split (as many as 16 over K = 2048: one step each) and warp count of the
# sweep; N = 200 is a whole number of none of the tiles.
@pytest.mark.parametrize("split_k", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block_n, num_warps", [(32, 2), (64, 4), (64, 8), (128, 8)])
@pytest.mark.parametrize("m", [1, 16])
def test_sweep_configs(m, block_n, num_warps, split_k):
    config = small_m(block_n, split_k, num_warps, num_stages=4)
    check(m, 2048, 200, 128, torch.float32, with_bias=True, config=config)


def test_bad_configs_are_refused():
    (x, qweight, scales, zeros), _ = operands(17, 256, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="split_k 2 needs M <= 16"):
        w4a16_gemm_triton(x, qweight, scales, zeros, 64, None, config=small_m(split_k=2))
    with pytest.raises(ValueError, match="block_k >= 128"):
        bad = W4a16Config(16, 64, 64, 1, 4, 3)
        w4a16_gemm_triton(x[:1], qweight, scales, zeros, 64, None, config=bad)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_split_k_replays_in_a_cuda_graph():
    (x, qweight, scales, zeros), bias = operands(1, 4096, 4096, 128, torch.bfloat16)
    config = small_m(split_k=8)

    def run():
        return w4a16_gemm_triton(x, qweight, scales, zeros, 128, bias, config=config)

    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = w4a16_gemm_torch(x, qweight, scales, zeros, 128, bias)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="Triton 3.9's interpreter mis-computes tl.dot on bf16")
def test_bfloat16_small():
    check(7, 256, 64, 64, torch.bfloat16, with_bias=True)


@pytest.mark.skipif(not ON_GPU, reason="Qwen3-8B shapes run on a CUDA device")
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("k, n", QWEN3_8B)
@pytest.mark.parametrize("m", [1, 16])
def test_qwen3_8b_shapes_bf16(m, k, n, group_size):
    check(m, k, n, k if group_size == -1 else group_size, torch.bfloat16, with_bias=False)
