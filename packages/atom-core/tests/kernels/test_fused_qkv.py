"""Fused q/k RMSNorm + rotary + KV write: Triton against the reference (the unfused ops),
and the attention layer's fused path against its unfused one.

The Triton cases run on a CUDA device (fp32 and bf16) or under Triton's interpreter on the
CPU (TRITON_INTERPRET=1, fp32), and are skipped otherwise (CI).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from atom.forward_context import AttentionMetadata, get_forward_context, set_forward_context
from atom.kernels import PagedKVCache
from atom.kernels.fused_qkv import fused_qkv_rope_write_kv, fused_qkv_rope_write_kv_torch
from atom.kernels.norm import rms_norm_torch
from atom.kernels.rotary import apply_rotary_emb_torch, compute_cos_sin_cache
from atom.layers.attention import Attention, attention_backend
from atom.layers.attention_spec import QKRope
from atom.layers.norm import RMSNorm
from atom.layers.paged_attention_impl import NativeAttentionImpl, write_kv_and_attend
from atom.layers.rotary import RotaryEmbedding

if torch.cuda.is_available():
    TRITON_DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    TRITON_DEVICE = "cpu"
else:
    TRITON_DEVICE = None
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None, reason="Triton needs a CUDA device (or TRITON_INTERPRET=1)"
)
# The interpreter computes bf16 through numpy, which has no bf16: check it on the GPU only.
DTYPES = [torch.float32, torch.bfloat16] if TRITON_DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SENTINEL = 7.0  # cache slots nobody writes keep it
NUM_TOKENS, MAX_POSITION, EPS = 13, 4096, 1e-6


def qkv_views(num_tokens, q_heads, kv_heads, head_dim, dtype, device, gen):
    """q, k, v as strided views of one fused projection output, as the models pass them."""
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
    )
    return (
        q.view(num_tokens, q_heads, head_dim),
        k.view(num_tokens, kv_heads, head_dim),
        v.view(num_tokens, kv_heads, head_dim),
    )


def caches(layout, num_slots, block_size, kv_heads, head_dim, dtype, device):
    """Key/value caches [num_blocks, block_size, Hkv, D] in each host's layout."""
    num_blocks = num_slots // block_size

    def filled(*shape):
        return torch.full(shape, SENTINEL, dtype=dtype, device=device)

    if layout == "atom":  # two contiguous tensors
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return filled(*shape), filled(*shape)
    if layout == "vllm":  # one [num_blocks, 2, block_size, Hkv, D] tensor: strided halves
        kv = filled(num_blocks, 2, block_size, kv_heads, head_dim)
        return kv[:, 0], kv[:, 1]
    assert layout == "sglang" and block_size == 1  # per-token pools [num_slots, Hkv, D]
    return (
        filled(num_slots, kv_heads, head_dim).unsqueeze(1),
        filled(num_slots, kv_heads, head_dim).unsqueeze(1),
    )


def check_against_reference(
    q_heads, kv_heads, head_dim, rotary_dim, is_neox, norm, layout, block_size, dtype
):
    from atom.kernels.triton.fused_qkv import fused_qkv_rope_write_kv_triton

    device, gen = TRITON_DEVICE, torch.Generator().manual_seed(head_dim + q_heads + kv_heads)
    q, k, v = qkv_views(NUM_TOKENS, q_heads, kv_heads, head_dim, dtype, device, gen)
    positions = torch.randint(0, MAX_POSITION, (NUM_TOKENS,), generator=gen).to(device)
    cos_sin, _ = compute_cos_sin_cache(rotary_dim, MAX_POSITION, 10000.0, None)
    num_slots = 64
    # Two padding tokens (-1) and one past the mapping (a host's padded batch).
    slots = torch.randperm(num_slots, generator=gen)[: NUM_TOKENS - 1]
    slots[[3, 8]] = -1
    weights = [None, None]
    if norm:
        weights = [torch.rand(head_dim, generator=gen).to(device, dtype) + 0.5 for _ in range(2)]
    args = (positions, cos_sin.to(device), rotary_dim, is_neox)
    got_caches = caches(layout, num_slots, block_size, kv_heads, head_dim, dtype, device)
    want_caches = caches(layout, num_slots, block_size, kv_heads, head_dim, dtype, device)
    raw_k = k.clone()
    want_k = k.clone()  # each op rotates its k in place: give the reference its own copy
    got = fused_qkv_rope_write_kv_triton(
        q, k, v, *args, *got_caches, slots.to(device), *weights, EPS
    )
    want = fused_qkv_rope_write_kv_torch(
        q, want_k, v, *args, *want_caches, slots.to(device), *weights, EPS
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])  # every row, padding included
    assert not torch.equal(k, raw_k)
    for got_cache, want_cache in zip(got_caches, want_caches):
        torch.testing.assert_close(got_cache, want_cache, **TOL[dtype])
    written = (want_caches[0] != SENTINEL).flatten(2).any(-1).sum().item()
    assert written == (slots >= 0).sum().item()  # the grid is not vacuous


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim",
    [(4, 4, 64), (8, 2, 128), (8, 1, 256), (12, 3, 128)],  # GQA 1, 4, 8, 4 (odd head counts)
)
def test_triton_matches_reference(q_heads, kv_heads, head_dim, partial, is_neox, norm, dtype):
    rotary_dim = head_dim // 2 if partial else head_dim
    check_against_reference(
        q_heads, kv_heads, head_dim, rotary_dim, is_neox, norm, "atom", 16, dtype
    )


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layout, block_size", [("atom", 1), ("vllm", 1), ("vllm", 16), ("sglang", 1)]
)
def test_triton_cache_layouts(layout, block_size, dtype):
    check_against_reference(8, 2, 128, 64, True, True, layout, block_size, dtype)


@needs_triton
def test_triton_no_tokens():
    from atom.kernels.triton.fused_qkv import fused_qkv_rope_write_kv_triton

    q, k, v = qkv_views(0, 4, 2, 64, torch.float32, TRITON_DEVICE, torch.Generator())
    key_cache, value_cache = caches("atom", 16, 16, 2, 64, torch.float32, TRITON_DEVICE)
    cos_sin = compute_cos_sin_cache(64, 16, 10000.0, None)[0].to(TRITON_DEVICE)
    empty = torch.empty(0, dtype=torch.long, device=TRITON_DEVICE)
    out = fused_qkv_rope_write_kv_triton(
        q, k, v, empty, cos_sin, 64, True, key_cache, value_cache, empty, None, None, EPS
    )
    assert out.shape == (0, 4, 64) and (key_cache == SENTINEL).all()


@pytest.mark.parametrize("norm", [True, False])
def test_reference_leaves_the_cached_keys_in_k(norm):
    """k afterwards holds what the unfused ops compute, for every row (slot -1 and rows
    past the mapping too), which is what the cache holds for the written ones."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv_views(6, 4, 2, 32, torch.float32, "cpu", gen)
    raw_k = k.clone()
    positions = torch.randint(0, 64, (6,), generator=gen)
    cos_sin = compute_cos_sin_cache(32, 64, 10000.0, None)[0]
    weight = torch.rand(32, generator=gen) + 0.5 if norm else None
    key_cache, value_cache = caches("atom", 16, 4, 2, 32, torch.float32, "cpu")
    slots = torch.tensor([3, -1, 7, 0, 12])
    fused_qkv_rope_write_kv(
        q, k, v, positions, cos_sin, 32, True, key_cache, value_cache, slots, weight, weight, EPS
    )
    normed = rms_norm_torch(raw_k, weight, EPS) if norm else raw_k
    _, want = apply_rotary_emb_torch(positions, q, normed, cos_sin, 32, True)
    assert torch.equal(k, want)
    written = slots >= 0
    assert torch.equal(key_cache.flatten(0, 1)[slots[written]], want[:5][written])


def test_norm_weights_come_in_pairs():
    q, k, v = qkv_views(2, 2, 1, 8, torch.float32, "cpu", torch.Generator())
    with pytest.raises(ValueError, match="both norm weights"):
        fused_qkv_rope_write_kv(
            q, k, v, torch.zeros(2, dtype=torch.long), torch.zeros(4, 8), 8, True,
            torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(2, dtype=torch.long),
            q_norm_weight=torch.ones(8),
        )  # fmt: skip


class UnfusedImpl(NativeAttentionImpl):
    """The path of a host kernel that cannot fuse: q/k normalised and rotated by the
    spec's QKRope first, then the native step over the spec without it."""

    def forward(self, q, k, v, positions):
        q, k = self.spec.qk_rope(positions, q, k)
        plain = dataclasses.replace(self.spec, qk_rope=None)
        cache = PagedKVCache(self.key_cache, self.value_cache)
        metadata = get_forward_context().attn_metadata
        return write_kv_and_attend(q, k, v, cache, metadata, plain, positions)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_layer_fused_path_equals_unfused(qk_norm):
    """The native impl rotates q/k in its KV-cache write; rotating them first and writing
    them as they are gives the same output and the same cache."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 4
    rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0)
    norms = [RMSNorm(head_dim, 1e-6) for _ in range(2)] if qk_norm else [None, None]
    for norm in filter(None, norms):
        norm.weight.data.uniform_(0.5, 1.5)
    qk_rope = QKRope(rope, *norms)
    # Two sequences: a decode with 5 cached tokens and a 3-token prefill.
    metadata = AttentionMetadata.build([1, 3], [6, 3], [[0, 1], [2]], [5, 8, 9, 10])
    positions = torch.tensor([5, 0, 1, 2])
    results = []
    for impl_cls in (NativeAttentionImpl, UnfusedImpl):
        # Fresh inputs each time: the fused path leaves the rotated keys in k.
        gen = torch.Generator().manual_seed(0)
        q, k, v = qkv_views(4, heads, kv_heads, head_dim, torch.float32, "cpu", gen)
        cached = torch.randn(3, block_size, kv_heads, head_dim, generator=gen)
        with attention_backend(impl_cls):
            layer = Attention(heads, head_dim, 0.2, kv_heads, "layer", qk_rope=qk_rope)
        layer.impl.bind_kv_cache((cached.clone(), cached.clone()))
        with set_forward_context(metadata):
            out = layer(q.flatten(1), k.flatten(1), v.flatten(1), positions)
        results.append((out, layer.impl.key_cache, layer.impl.value_cache))
    for fused, unfused in zip(*results):
        assert torch.equal(fused, unfused)
