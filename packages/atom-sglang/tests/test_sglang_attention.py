"""The attention math of ATOM's SGLang backend: MHA (windows, fp8 pools, fused q/k rope)
and MLA against dense references."""

from __future__ import annotations

import pytest
import torch
from backend_fakes import (
    FakePool,
    fill_prefixes,
    history,
    layer,
    make_backend,
    make_batch,
    reference,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from atom_sglang.backend import atom_sliding_window


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "prefix_lens,new_lens,window",
    [([0, 5, 17], [7, 3, 1], -1), ([9, 30, 2, 11], [1, 1, 1, 1], -1), ([0, 12], [20, 4], 5)],
)
def test_mha_backend_matches_dense_attention(page_size, prefix_lens, new_lens, window):
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    req_to_token, batch = make_batch(prefix_lens, new_lens, page_size, 256)
    pool = FakePool(256, hkv, d, d, page_size)
    backend = make_backend(req_to_token, pool, page_size)
    hist = history(prefix_lens, new_lens, hkv, d, d)
    fill_prefixes(pool.k, pool.v, req_to_token, batch, hist, prefix_lens)
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    backend.init_forward_metadata(batch)
    md = backend.step_metadata
    assert md.num_decodes == (batch.batch_size if batch.forward_mode.is_decode() else 0)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), v_new.flatten(1), layer(hq, hkv, d, d, window), batch
    )
    want = reference(q, hist, prefix_lens, new_lens, d**-0.5, atom_sliding_window(window))
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.k[batch.out_cache_loc], k_new)  # the KV write
    assert backend.num_calls == 1


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_mha_backend_reads_an_fp8_pool_with_layer_scales(prefix_lens, new_lens):
    """SGLang's fp8_e4m3 pool (uint8 storage) holds x / scale with the layer's
    k_scale_float / v_scale_float: attention equals dense attention over the dequantized
    K/V, and the new tokens' K/V land quantized in their slots."""
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    k_scale, v_scale = 0.05, 0.02
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = MHATokenToKVPool(256, 1, torch.float8_e4m3fn, hkv, d, 1, "cpu", False)
    backend = make_backend(req_to_token, pool, 1)
    hist = history(prefix_lens, new_lens, hkv, d, d)

    def fp8(x, scale):
        return (x / scale).to(torch.float8_e4m3fn)

    stored = [
        (fp8(k, k_scale).view(torch.uint8), fp8(v, v_scale).view(torch.uint8)) for k, v in hist
    ]
    fill_prefixes(pool.k_buffer[0], pool.v_buffer[0], req_to_token, batch, stored, prefix_lens)
    k_new = torch.cat([k[p:] for (k, _), p in zip(hist, prefix_lens)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(hist, prefix_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    attn = layer(hq, hkv, d, d)
    attn.k_scale_float, attn.v_scale_float = k_scale, v_scale
    backend.init_forward_metadata(batch)
    out = backend.forward(q.flatten(1), k_new.flatten(1), v_new.flatten(1), attn, batch)
    read = [(fp8(k, k_scale).float() * k_scale, fp8(v, v_scale).float() * v_scale) for k, v in hist]
    want = reference(q, read, prefix_lens, new_lens, d**-0.5)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    written = pool.k_buffer[0][batch.out_cache_loc]
    assert torch.equal(written, fp8(k_new, k_scale).view(torch.uint8))


def test_backend_refuses_pools_its_kernels_cannot_read():
    req_to_token, _ = make_batch([0], [4], 1, 64)
    e5m2 = MHATokenToKVPool(64, 1, torch.float8_e5m2, 2, 32, 1, "cpu", False)
    with pytest.raises(
        NotImplementedError, match="float8_e5m2 KV cache; use --kv-cache-dtype fp8_e4m3"
    ):
        make_backend(req_to_token, e5m2, 1)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_atom_layer_route_equals_sglang_layer_route(prefix_lens, new_lens):
    """An ATOM layer under ATOM's backend (raw q/k; its spec's q/k norm + rotary fused
    with the cache write; the step's metadata from ATOM's forward context) gives the
    output and cache of SGLang's own layer route through the backend, q/k rotated first."""
    from atom.forward_context import set_forward_context
    from atom.layers.attention_spec import AttentionSpec, QKRope
    from atom.layers.norm import RMSNorm
    from atom.layers.rotary import RotaryEmbedding
    from atom_sglang.attention_layer import SglangAttention

    torch.manual_seed(2)
    hq, hkv, d = 4, 2, 32
    q_norm, k_norm = RMSNorm(d), RMSNorm(d)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    qk_rope = QKRope(RotaryEmbedding(d, d, 256, 10000.0), q_norm, k_norm)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    q = torch.randn(sum(new_lens), hq, d)
    k, v = torch.randn(sum(new_lens), hkv, d), torch.randn(sum(new_lens), hkv, d)
    runs = {}
    for atom_route in (False, True):
        req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
        pool = FakePool(256, hkv, d, d, 1)
        backend = make_backend(req_to_token, pool, 1)
        backend.init_forward_metadata(batch)
        if atom_route:
            spec = AttentionSpec(
                "model.layers.0.self_attn.attn", hq, hkv, d, d, d**-0.5, qk_rope=qk_rope
            )
            impl = SglangAttention(spec)
            impl.bind_kv_pool(pool, 1, 0)
            with set_forward_context(backend.step_metadata):
                out = impl(q.clone(), k.clone(), v, positions)
        else:
            qr, kr = qk_rope(positions, q.clone(), k.clone())
            out = backend.forward(
                qr.flatten(1), kr.flatten(1), v.flatten(1), layer(hq, hkv, d, d), batch
            )
        runs[atom_route] = (out.reshape(out.shape[0], -1), pool.k[batch.out_cache_loc])
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 6], [9, 4]), ([5, 13, 1], [1, 1, 1])])
def test_mla_backend_matches_latent_mqa(prefix_lens, new_lens):
    """Absorbed MLA: q [T, H, L+R] over latent rows [L+R]; values = first L channels."""
    torch.manual_seed(2)
    h, latent, rope = 4, 64, 16
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = FakePool(256, 1, latent + rope, latent, 1, mla_latent=latent)
    backend = make_backend(req_to_token, pool, 1)
    assert backend.is_mla
    rows = [torch.randn(p + n, 1, latent + rope) for p, n in zip(prefix_lens, new_lens)]
    hist = [(r, r[..., :latent]) for r in rows]
    fill_prefixes(pool.kv, None, req_to_token, batch, hist, prefix_lens)
    k_new = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)])
    q = torch.randn(sum(new_lens), h, latent + rope)
    mla_layer = layer(h, 1, latent + rope, latent)
    backend.init_forward_metadata(batch)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), k_new[..., :latent].flatten(1), mla_layer, batch
    )
    want = reference(q, hist, prefix_lens, new_lens, (latent + rope) ** -0.5)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.kv[batch.out_cache_loc], k_new)


@pytest.mark.parametrize("prefix_lens,new_lens", [([0, 5, 17], [7, 3, 1]), ([9, 30], [1, 1])])
def test_mla_backend_reads_an_fp8_latent_pool(prefix_lens, new_lens):
    """SGLang's MLA pool in fp8_e4m3 (uint8 storage) with the layer's k_scale_float:
    absorbed MLA over the dequantized latent rows."""
    torch.manual_seed(2)
    h, latent, rope, kv_scale = 4, 64, 16, 0.05
    req_to_token, batch = make_batch(prefix_lens, new_lens, 1, 256)
    pool = MLATokenToKVPool(256, 1, torch.float8_e4m3fn, latent, rope, 1, "cpu", False)
    backend = make_backend(req_to_token, pool, 1)
    rows = [torch.randn(p + n, 1, latent + rope) for p, n in zip(prefix_lens, new_lens)]
    stored = [((r / kv_scale).to(torch.float8_e4m3fn).view(torch.uint8), None) for r in rows]
    fill_prefixes(pool.kv_buffer[0], None, req_to_token, batch, stored, prefix_lens)
    k_new = torch.cat([r[p:] for r, p in zip(rows, prefix_lens)])
    q = torch.randn(sum(new_lens), h, latent + rope)
    mla_layer = layer(h, 1, latent + rope, latent)
    mla_layer.k_scale_float = kv_scale
    backend.init_forward_metadata(batch)
    out = backend.forward(
        q.flatten(1), k_new.flatten(1), k_new[..., :latent].flatten(1), mla_layer, batch
    )
    read = [(r / kv_scale).to(torch.float8_e4m3fn).float() * kv_scale for r in rows]
    want = reference(
        q, [(r, r[..., :latent]) for r in read], prefix_lens, new_lens, (latent + rope) ** -0.5
    )
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-5)


def test_impls_satisfy_atoms_protocols():
    from atom.layers.attention_impl import AttentionImpl, MLAImpl, SparseMLAImpl
    from atom.testing.contract import contract_problems
    from atom_sglang.attention_layer import SglangAttention, SglangMLAAttention

    assert contract_problems(SglangAttention, AttentionImpl) == []
    assert contract_problems(SglangMLAAttention, MLAImpl) == []
    assert contract_problems(SglangMLAAttention, SparseMLAImpl) == []
