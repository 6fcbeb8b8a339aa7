"""One MLA composition for every host: `NativeMLAImpl` absorbs W_UK / W_UV around
whichever attention runs the step, ATOM's kernels (`attend`) or a host's latent
attention (`attend_through`), with the same result."""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import AttentionMetadata
from atom.kernels import mla_latent_attention, write_mla_cache
from atom.layers.attention_spec import AttentionSpec
from atom.layers.mla_impl import NativeMLAImpl

HEADS, NOPE, ROPE, V_DIM, LATENT, BLOCK = 4, 16, 8, 12, 32, 4


def impl() -> NativeMLAImpl:
    torch.manual_seed(0)
    spec = AttentionSpec(
        layer_name="attn", num_heads=HEADS, num_kv_heads=1, head_dim=NOPE + ROPE,
        v_head_dim=V_DIM, scale=(NOPE + ROPE) ** -0.5, kind="MLA", kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE, kv_b_proj=nn.Linear(LATENT, HEADS * (NOPE + V_DIM), bias=False),
    )  # fmt: skip
    mla = NativeMLAImpl(spec)
    mla.process_weights_after_loading()
    return mla


def test_a_hosts_latent_attention_gives_atoms_result():
    mla = impl()
    # A decode with 5 cached tokens and a 3-token prefill.
    metadata = AttentionMetadata.build([1, 3], [6, 3], [[0, 1], [2]], [5, 8, 9, 10])
    cached = torch.randn(3, BLOCK, LATENT + ROPE)
    q_nope, q_pe = torch.randn(4, HEADS, NOPE), torch.randn(4, HEADS, ROPE)
    kv_c, k_pe = torch.randn(4, LATENT), torch.randn(4, ROPE)

    atom_cache = cached.clone()
    want = mla.attend(q_nope, q_pe, kv_c, k_pe, atom_cache, metadata)

    host_cache = cached.clone()

    def host_latent_attention(q, k, v):
        write_mla_cache(k[:, 0, :LATENT], k[:, 0, LATENT:], host_cache, metadata.slot_mapping)
        return mla_latent_attention(q, host_cache, metadata, mla.spec.scale, LATENT)

    got = mla.attend_through(q_nope, q_pe, kv_c, k_pe, host_latent_attention)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(host_cache, atom_cache)
