"""Every Triton kernel against its torch reference.

Runs on a CUDA device (the lent GPU machine); on CPU it runs only under Triton's
interpreter (TRITON_INTERPRET=1), and is skipped otherwise (CI).
"""

from __future__ import annotations

import random

import pytest
import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.activation import silu_and_mul_torch
from atom.kernels.kv_cache import write_kv_cache_torch
from atom.kernels.norm import (
    fused_add_rms_norm_torch,
    gated_rms_norm_torch,
    rms_norm_torch,
    zero_centred_rms_norm_torch,
)
from atom.kernels.paged_attention import paged_attention_torch
from atom.kernels.rotary import apply_rotary_emb_torch, compute_cos_sin_cache
from atom.testing.triton_device import triton_test_device

triton = pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import activation, kv_cache, norm, paged_attention, rotary  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# The interpreter computes bf16 through numpy, which has no bf16: check it on the GPU only.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
def test_rms_norm(dtype, hidden):
    x = torch.randn(37, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(
        norm.rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), **TOL[dtype]
    )
    got = norm.fused_add_rms_norm_triton(x, residual, w, 1e-6)
    want = fused_add_rms_norm_torch(x, residual, w, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


def head_split(tokens: int, heads: int, dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [tokens, heads, dim] halves of one projection, as Qwen3-Next's q and gate and
    Gated DeltaNet's z arrive: strided views, read in place."""
    both = torch.randn(tokens, heads, 2 * dim, device=DEVICE, dtype=dtype)
    return both.chunk(2, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rows", "head-split"])
def test_zero_centred_rms_norm(dtype, layout):
    """Qwen3-Next's norm, (1 + w) in fp32: rows with and without a residual, and q heads
    of a strided view."""
    x = (
        head_split(19, 4, 128, dtype)[0]
        if layout == "head-split"
        else torch.randn(19, 1000, device=DEVICE, dtype=dtype)
    )
    w = torch.randn(x.shape[-1], device=DEVICE, dtype=dtype) * 0.1
    torch.testing.assert_close(
        norm.zero_centred_rms_norm_triton(x, w, 1e-6),
        zero_centred_rms_norm_torch(x, w, 1e-6),
        **TOL[dtype],
    )
    residual = torch.randn(x.shape, device=DEVICE, dtype=dtype)
    got = norm.zero_centred_rms_norm_triton(x, w, 1e-6, residual)
    want = zero_centred_rms_norm_torch(x, w, 1e-6, residual)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_layout", ["head-split", "transposed"])
def test_gated_rms_norm(dtype, gate_layout):
    """Gated DeltaNet's output norm: x [T, Hv, Dv] contiguous, the gate a strided view
    (read in place) or one without a unit last stride (copied)."""
    x = torch.randn(23, 8, 128, device=DEVICE, dtype=dtype)
    if gate_layout == "head-split":
        gate = head_split(23, 8, 128, dtype)[1]
    else:
        gate = torch.randn(23, 128, 8, device=DEVICE, dtype=dtype).transpose(1, 2)
    w = torch.randn(128, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(
        norm.gated_rms_norm_triton(x, gate, w, 1e-6),
        gated_rms_norm_torch(x, gate, w, 1e-6),
        **TOL[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 3072, 1536])
def test_silu_and_mul(dtype, width):
    x = torch.randn(29, 2 * width, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(
        activation.silu_and_mul_triton(x), silu_and_mul_torch(x), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (128, 64), (256, 256)])
def test_rotary(dtype, is_neox, head_dim, rotary_dim):
    cache, _ = compute_cos_sin_cache(rotary_dim, 4096, 10000.0, None)
    cache = cache.to(DEVICE)
    positions = torch.randint(0, 4096, (41,), device=DEVICE)
    qkv = torch.randn(41, 12 * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : 8 * head_dim].view(41, 8, head_dim)  # strided views, as in the models
    k = qkv[:, 8 * head_dim :].view(41, 4, head_dim)
    got = rotary.apply_rotary_emb_triton(positions, q, k, cache, rotary_dim, is_neox)
    want = apply_rotary_emb_torch(positions, q, k, cache, rotary_dim, is_neox)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype):
    num_blocks, block_size, heads, dim = 32, 16, 4, 128
    key = torch.randn(50, heads, dim, device=DEVICE, dtype=dtype)
    value = torch.randn(50, heads, 64, device=DEVICE, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:50]
    slots[::7] = -1
    caches = [
        torch.zeros(num_blocks, block_size, heads, d, device=DEVICE, dtype=dtype)
        for d in (dim, 64, dim, 64)
    ]
    kv_cache.write_kv_cache_triton(key, value, caches[0], caches[1], slots)
    write_kv_cache_torch(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def random_batch(decode_ctx, prefills, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    """A decode-first batch with pages scattered over the pool; K/V already in the cache.

    prefills: (cached context, new tokens) per prefill sequence.
    """
    rng = random.Random(seed)
    query_lens = [1] * len(decode_ctx) + [n for _, n in prefills]
    seq_lens = [c + 1 for c in decode_ctx] + [c + n for c, n in prefills]
    pages_needed = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(pages_needed) + 8))
    rng.shuffle(pool)
    tables = []
    for n in pages_needed:
        tables.append(pool[:n])
        pool = pool[n:]
    num_blocks = max(max(t) for t in tables) + 1
    slots = []
    for q, s, t in zip(query_lens, seq_lens, tables):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=DEVICE)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(
        DEVICE, dtype
    )
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(
        DEVICE, dtype
    )
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(DEVICE, dtype)
    return query, k_cache, v_cache, md


ATTENTION_CASES = [
    # decode contexts, prefills (context, new), block size, q heads, kv heads, head dim
    ([5, 200, 1000], [(0, 17), (33, 64), (0, 1)], 16, 8, 2, 128),
    ([8191], [], 16, 32, 8, 128),
    ([], [(0, 300), (120, 77)], 16, 4, 4, 64),
    ([3, 70], [(10, 40)], 1, 8, 1, 64),
    ([300], [(500, 100)], 32, 16, 2, 256),
    ([1, 2, 3, 4], [(0, 5)], 16, 12, 4, 128),  # group of 3 (not a power of two)
    ([*range(1, 129, 2)], [(20, 9)], 16, 16, 8, 64),  # 64 x 8 programs: one split each
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
@pytest.mark.parametrize("window, soft_cap", [(None, None), (37, None), (None, 30.0)])
def test_paged_attention(dtype, case, window, soft_cap):
    decodes, prefills, block_size, heads, kv_heads, head_dim = ATTENTION_CASES[case]
    query, k_cache, v_cache, md = random_batch(
        decodes, prefills, block_size, heads, kv_heads, head_dim, dtype
    )
    scale = head_dim**-0.5
    got = paged_attention.paged_attention_triton(
        query, k_cache, v_cache, md, scale, window, soft_cap, torch.empty_like(query)
    )
    want = paged_attention_torch(
        query, k_cache, v_cache, md, scale, window, soft_cap, torch.empty_like(query)
    )
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


# GPT-OSS attention: 64 q / 8 kv heads of 64 dims, sliding window 128 on every other layer.
# Contexts around and past the window and off the block size; few decodes run split-K
# and its reduce, 64 and more fill the GPU with one split each (no reduce).
SINK_CASES = {
    "split-K": ([3, 127, 128, 129, 1000], [(0, 300), (130, 7)], 16, 64, 8, 64),
    "one split": ([*range(1, 1000, 15)], [(200, 1)], 16, 64, 8, 64),
}


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SINK_CASES))
@pytest.mark.parametrize("window", [None, 128, 5])
def test_paged_attention_with_sinks(window, case, dtype, sink_dtype):
    decodes, prefills, block_size, heads, kv_heads, head_dim = SINK_CASES[case]
    query, k_cache, v_cache, md = random_batch(
        decodes, prefills, block_size, heads, kv_heads, head_dim, dtype
    )
    # Around the scores' range, the last head's far above them (it attends almost nowhere).
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 2
    sinks[-1] = 30.0
    sinks = sinks.to(DEVICE, sink_dtype)
    scale = head_dim**-0.5
    got = paged_attention.paged_attention_triton(
        query, k_cache, v_cache, md, scale, window, None, torch.empty_like(query), sinks=sinks
    )
    want = paged_attention_torch(
        query, k_cache, v_cache, md, scale, window, None, torch.empty_like(query), sinks=sinks
    )
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
