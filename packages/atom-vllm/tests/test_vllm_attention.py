"""The attention math of ATOM's vLLM backend: capabilities, and the MHA impl (windows,
fused q/k rope, fp8 caches) against dense attention."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm_steps import common_metadata

from atom.forward_context import set_forward_context
from atom.kernels.paged_attention import attention_mask, dense_attention
from atom.layers.attention_spec import AttentionSpec
from atom_vllm.backend import (
    AtomAttentionBackend,
    AtomAttentionImpl,
    AtomAttentionMetadataBuilder,
    to_atom_metadata,
)


def test_backend_declares_capabilities():
    b = AtomAttentionBackend
    assert b.get_name() == "CUSTOM"
    assert b.supports_block_size(16) and b.supports_block_size(1)
    assert b.supports_sliding_window() and b.supports_sink() and not b.is_mla()
    assert b.supports_dtype(torch.float32) and b.supports_dtype(torch.bfloat16)
    assert b.supports_kv_cache_dtype("fp8") and b.supports_kv_cache_dtype("fp8_e4m3")
    assert not b.supports_kv_cache_dtype("fp8_e5m2")
    assert AtomAttentionMetadataBuilder.reorder_batch_threshold == 1
    assert (
        AtomAttentionMetadataBuilder._cudagraph_support
        == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def atom_impl(hq, d, hkv, kv_cache_dtype, **spec_fields):
    """The impl as vLLM's `Attention` builds it, holding ATOM's spec as VllmAttention
    hands it over."""
    impl = AtomAttentionImpl(hq, d, d**-0.5, hkv, None, None, kv_cache_dtype)
    impl.spec = AttentionSpec("layer", hq, hkv, d, d, d**-0.5, **spec_fields)
    return impl


def cached_history(cm, context, query, hkv, d, bs, cache, stored):
    """Random K/V of each sequence's context and new tokens; the context's rows written
    into `cache` as earlier steps would have, each as `stored(k, v)` gives it."""
    history = []
    for i, c in enumerate(context):
        k, v = torch.randn(c + query[i], hkv, d), torch.randn(c + query[i], hkv, d)
        history.append((k, v))
        for p in range(c):
            page = int(cm.block_table_tensor[i, p // bs])
            cache[page, :, p % bs] = torch.cat(stored(k[p], v[p]), dim=-1)
    return history


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_impl_writes_cache_then_matches_dense_attention(sliding_window):
    torch.manual_seed(0)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    context, query = [7, 20, 0, 4], [1, 1, 5, 9]
    cm = common_metadata(query, context, bs, nb)
    md = to_atom_metadata(cm)
    # vLLM's logical per-layer view [num_blocks, Hkv, block_size, D + Dv], stored
    # tokens-major (its default LBNHC layout) as vLLM allocates it.
    kv_cache = torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)
    # The cached context of each sequence, written as earlier steps would have.
    history = cached_history(cm, context, query, hkv, d, bs, kv_cache, lambda k, v: (k, v))
    q = torch.randn(sum(query), hq, d)
    k_new = torch.cat([k[c:] for (k, _), c in zip(history, context)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(history, context)])
    impl = atom_impl(hq, d, hkv, "auto", sliding_window=sliding_window)
    out = torch.empty(sum(query), hq, d)
    with set_forward_context(md):
        impl.forward(None, q, k_new, v_new, kv_cache, md, out)
    start = 0
    for (k, v), c, n in zip(history, context, query):
        positions = torch.arange(c, c + n)
        mask = attention_mask(positions, c + n, sliding_window)
        want = dense_attention(q[start : start + n], k, v, mask, d**-0.5, None)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n
    assert impl.num_calls == 1
    # The new tokens' K/V went to their slots, K first and V after it in each row.
    for slot, k_row, v_row in zip(cm.slot_mapping.tolist(), k_new, v_new):
        row = kv_cache[slot // bs, :, slot % bs]
        assert torch.equal(row, torch.cat([k_row, v_row], dim=-1))


def test_impl_rotates_with_the_positions_of_its_metadata():
    """A layer built with `qk_rope` gets raw q/k; the impl rotates them with the step
    metadata's positions (vLLM's CommonAttentionMetadata.positions) as it writes the cache:
    the same output as rotating first and attending without it."""
    from atom.layers.attention_spec import QKRope
    from atom.layers.rotary import RotaryEmbedding

    torch.manual_seed(1)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    context, query = [0, 0], [5, 3]
    cm = common_metadata(query, context, bs, nb)
    cm.positions = torch.cat([torch.arange(n) for n in query])
    rope = QKRope(RotaryEmbedding(d, d, 64, 10000.0))
    q, k, v = torch.randn(8, hq, d), torch.randn(8, hkv, d), torch.randn(8, hkv, d)

    def run(impl, q, k):
        kv_cache = torch.zeros(nb, bs, hkv, 2 * d).transpose(1, 2)
        out = torch.empty(8, hq, d)
        md = to_atom_metadata(cm)
        with set_forward_context(md):
            impl.forward(None, q.clone(), k.clone(), v, kv_cache, md, out)
        return out

    fused = atom_impl(hq, d, hkv, "auto", qk_rope=rope)
    plain = atom_impl(hq, d, hkv, "auto")
    q_rot, k_rot = rope(cm.positions, q.clone(), k.clone())
    torch.testing.assert_close(run(fused, q, k), run(plain, q_rot, k_rot))
    cm.positions = None
    with pytest.raises(ValueError, match="positions"):
        run(fused, q, k)


def test_impl_reads_an_fp8_cache_with_its_scales():
    """vLLM allocates an fp8 cache as uint8: the impl writes and reads it as float8_e4m3fn
    holding x / scale, so attention equals dense attention over the dequantized K/V."""
    torch.manual_seed(0)
    hq, hkv, d, bs, nb = 4, 2, 32, 4, 64
    k_scale, v_scale = 0.05, 0.02
    context, query = [7, 20, 0], [1, 1, 6]
    cm = common_metadata(query, context, bs, nb)
    kv_cache = torch.zeros(nb, bs, hkv, 2 * d, dtype=torch.uint8).transpose(1, 2)
    fp8 = kv_cache.view(torch.float8_e4m3fn)

    def fp8_round_trip(x, scale):
        return (x / scale).to(torch.float8_e4m3fn).float() * scale

    def quantized(k, v):
        return (k / k_scale).to(torch.float8_e4m3fn), (v / v_scale).to(torch.float8_e4m3fn)

    history = cached_history(cm, context, query, hkv, d, bs, fp8, quantized)
    q = torch.randn(sum(query), hq, d)
    k_new = torch.cat([k[c:] for (k, _), c in zip(history, context)])
    v_new = torch.cat([v[c:] for (_, v), c in zip(history, context)])
    impl = atom_impl(hq, d, hkv, "fp8")
    impl.k_scale, impl.v_scale = k_scale, v_scale
    out = torch.empty(sum(query), hq, d)
    md = to_atom_metadata(cm)
    with set_forward_context(md):
        impl.forward(None, q, k_new, v_new, kv_cache, md, out)
    start = 0
    for (k, v), c, n in zip(history, context, query):
        mask = attention_mask(torch.arange(c, c + n), c + n, None)
        k_read, v_read = fp8_round_trip(k, k_scale), fp8_round_trip(v, v_scale)
        want = dense_attention(q[start : start + n], k_read, v_read, mask, d**-0.5, None)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-5, atol=1e-5)
        start += n


def test_impl_rejects_what_it_cannot_do():
    with pytest.raises(NotImplementedError, match="fp8_e5m2.*supported: .*fp8_e4m3"):
        AtomAttentionImpl(4, 32, 0.1, 2, None, None, "fp8_e5m2")
    with pytest.raises(NotImplementedError, match="ALiBi"):
        AtomAttentionImpl(4, 32, 0.1, 2, [0.1] * 4, None, "auto")


def test_mla_backend_declares_latent_cache():
    from atom_vllm.backend import AtomMLABackend, AtomMLAMetadataBuilder

    assert AtomMLABackend.is_mla() and AtomMLABackend.get_name() == "CUSTOM"
    assert AtomMLABackend.supports_kv_cache_dtype("fp8")
    assert AtomMLABackend.get_builder_cls() is AtomMLAMetadataBuilder
    assert AtomMLAMetadataBuilder.reorder_batch_threshold == 1
    assert not AtomMLABackend.supports_pcp()  # get_impl_cls: ATOM's impl, not vLLM's


def test_impls_satisfy_atoms_protocols():
    from atom.layers.attention_impl import AttentionImpl, MLAImpl, SparseMLAImpl
    from atom.testing.contract import contract_problems
    from atom_vllm.attention_layer import VllmAttention, VllmMLAAttention

    assert contract_problems(VllmAttention, AttentionImpl) == []
    assert contract_problems(VllmMLAAttention, MLAImpl) == []
    assert contract_problems(VllmMLAAttention, SparseMLAImpl) == []
