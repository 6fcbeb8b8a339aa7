"""The attention layer: owns its shape, delegates paged-KV work to a host's AttentionImpl.

A host chooses the implementation while the model is built (`attention_backend(...)`);
the default is ATOM's native paged attention. At run time the impl reads the step's
`AttentionMetadata` from the forward context (DESIGN.md §3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a host needs to allocate a layer's KV cache and run its attention."""

    layer_name: str
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (for MLA: 1, the latent)
    head_dim: int  # query/key head dim
    v_head_dim: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kind: str = "MHA"  # "MHA" or "MLA"
    # MLA only: latent width, rope width, and the model's kv_b_proj for absorption.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_b_proj: Any = None


ImplFactory = Callable[[AttentionSpec], nn.Module]


def _native_impl(spec: AttentionSpec) -> nn.Module:
    if spec.kind == "MLA":
        from atom.layers.mla_impl import NativeMLAImpl

        return NativeMLAImpl(spec)
    from atom.layers.paged_attention_impl import NativeAttentionImpl

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
    """The impl the current host's factory builds for `spec` (MHA and MLA layers alike)."""
    return _impl_factory(spec)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    forward takes q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv] and returns [T, Hq*Dv].
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
        )
        self.impl = create_attention_impl(self.spec)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        out = self.impl(
            q.view(-1, spec.num_heads, spec.head_dim),
            k.view(-1, spec.num_kv_heads, spec.head_dim),
            v.view(-1, spec.num_kv_heads, spec.v_head_dim),
        )
        return out.reshape(-1, spec.num_heads * spec.v_head_dim)
