"""The attention layer: owns its shape, delegates paged-KV work to a host's AttentionImpl.

A host chooses the implementation while the model is built (`attention_backend(...)`);
the default is ATOM's native paged attention. At run time the impl reads the step's
`AttentionMetadata` from the forward context (docs/architecture.md).

Impl contract: `impl(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv]) -> [T,Hq,Dv]` with q and k
final. A layer whose model normalises and rotates q/k (`AttentionSpec.qk_rope`) applies
that itself, unless its impl declares `fuses_qk_rope = True`: such an impl gets raw q/k
and `positions=` and applies `spec.qk_rope` together with its KV-cache write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from atom.kernels import fused_qkv_rope_write_kv
from atom.layers.norm import RMSNorm
from atom.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class QKRope:
    """What a layer does to q and k between its projection and the KV cache: an optional
    per-head RMSNorm of each (Qwen3), then rotary. Holds the model's own modules (their
    weights load under the model's names)."""

    rotary_emb: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def __post_init__(self):
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("QKRope normalises q and k together: give both norms or neither")
        if self.q_norm is not None and self.q_norm.eps != self.k_norm.eps:
            raise ValueError("q_norm and k_norm must share one eps")

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused path: q [T, Hq, D], k [T, Hkv, D] normalised and rotated."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary_emb(positions, q, k)

    def apply_and_write_kv(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The fused path: writes rotated k and v into the cache, leaves the rotated k in k
        (in place: attention reads the new keys from it), returns rotated q."""
        rope, norm = self.rotary_emb, self.q_norm is not None
        return fused_qkv_rope_write_kv(
            q, k, v, positions, rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style,
            key_cache, value_cache, slot_mapping,
            self.q_norm.weight if norm else None,
            self.k_norm.weight if norm else None,
            self.q_norm.eps if norm else 0.0,
        )  # fmt: skip


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
    # MHA: the q/k norm + rotary the model applies before the cache (see QKRope).
    qk_rope: QKRope | None = None


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

    forward takes q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*Dv] (views of one qkv projection
    are fine) and returns [T, Hq*Dv]. Built with `qk_rope`, the layer takes raw q and k
    and `positions` [T], and normalises/rotates them before (or, through a fusing impl,
    together with) the KV-cache write.
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
        )
        self.impl = create_attention_impl(self.spec)
        self.fuses_qk_rope = qk_rope is not None and getattr(self.impl, "fuses_qk_rope", False)

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
        if self.fuses_qk_rope:
            out = self.impl(q, k, v, positions=positions)
        else:
            if spec.qk_rope is not None:
                q, k = spec.qk_rope(positions, q, k)
            out = self.impl(q, k, v)
        return out.reshape(-1, spec.num_heads * spec.v_head_dim)
