"""The attention layer: owns its shape, delegates paged-KV work to a host's AttentionImpl.

A host chooses the implementation while the model is built (`attention_backend(...)`);
the default is ATOM's native paged attention. At run time the impl reads the step's
`AttentionMetadata` from the forward context (docs/architecture.md).

The impl contract is `atom.layers.attention_impl` (`AttentionImpl`, `MLAImpl`): the impl
holds the layer's spec, gets raw q/k with `positions`, and applies the spec's q/k norm +
rotary (`AttentionSpec.qk_rope`) itself. The spec and QKRope live in
`atom.layers.attention_spec`, which impls import (so the native impls are this module's
default without a circle).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from atom.layers.attention_impl import AttentionImpl, MLAImpl
from atom.layers.attention_spec import AttentionSpec, ImplFactory, QKRope
from atom.layers.compressed_attention_impl import CompressedAttentionImpl
from atom.layers.mla_impl import NativeMLAImpl
from atom.layers.paged_attention_impl import NativeAttentionImpl


def _native_impl(spec: AttentionSpec) -> AttentionImpl | MLAImpl | CompressedAttentionImpl:
    if spec.kind == "MLA":
        return NativeMLAImpl(spec)
    if spec.kind == "compressed":  # DeepSeek-V4 (a CompressedAttentionSpec)
        return CompressedAttentionImpl(spec)
    return NativeAttentionImpl(spec)


_impl_factory: ImplFactory = _native_impl


@contextmanager
def attention_backend(factory: ImplFactory) -> Iterator[None]:
    """Builds the attention layers created inside the block with `factory`."""
    global _impl_factory
    previous = _impl_factory
    _impl_factory = factory
    try:
        yield
    finally:
        _impl_factory = previous


def create_attention_impl(spec: AttentionSpec) -> nn.Module:
    """The impl the current host's factory builds for `spec` (MHA, MLA and DeepSeek-V4's
    compressed layers alike)."""
    return _impl_factory(spec)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    forward takes q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv] (views of one qkv projection
    are fine) and returns [T, Hq*Dv]. Built with `qk_rope`, the layer takes raw q and k
    and `positions` [T]; its impl normalises/rotates them with the KV-cache write. `sinks` [num_heads]: the model's attention-sink
    parameter (GPT-OSS), held by reference, so weights loaded into it later take effect.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        prefix: str,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        v_head_dim: int | None = None,
        qk_rope: QKRope | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.spec = AttentionSpec(
            layer_name=prefix,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim or head_dim,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            qk_rope=qk_rope,
            sinks=sinks,
        )
        self.impl = create_attention_impl(self.spec)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec = self.spec
        q = q.view(-1, spec.num_heads, spec.head_dim)
        k = k.view(-1, spec.num_kv_heads, spec.head_dim)
        v = v.view(-1, spec.num_kv_heads, spec.v_head_dim)
        out = self.impl(q, k, v, positions)
        return out.reshape(-1, spec.num_heads * spec.v_head_dim)
