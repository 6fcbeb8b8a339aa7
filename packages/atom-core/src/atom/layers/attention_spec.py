"""What a host needs to know about one attention layer: its shape (`AttentionSpec`) and
the q/k norm + rotary its model applies before the KV cache (`QKRope`).

The contract between a model's attention layers (`atom.layers.attention`) and the
`AttentionImpl`s that hosts supply (native: `paged_attention_impl`, `mla_impl`; vLLM and
SGLang: their plugins). Impls and hosts import it from here; the layer module builds on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from atom.kernels import AttentionScoring, fused_qkv_rope_write_kv
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
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """The fused path: writes rotated k and v into the cache, leaves the rotated k in k
        (in place: attention reads the new keys from it), returns rotated q. k_scale /
        v_scale: an fp8 cache's per-tensor scales."""
        rope, norm = self.rotary_emb, self.q_norm is not None
        return fused_qkv_rope_write_kv(
            q, k, v, positions, rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style,
            key_cache, value_cache, slot_mapping,
            self.q_norm.weight if norm else None,
            self.k_norm.weight if norm else None,
            self.q_norm.eps if norm else 0.0,
            k_scale=k_scale, v_scale=v_scale,
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
    kind: str = "MHA"  # "MHA", "MLA", or "compressed" (CompressedAttentionSpec, DeepSeek-V4)
    # MLA only: latent width, rope width, and the model's kv_b_proj for absorption.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_b_proj: Any = None
    # MLA with DeepSeek Sparse Attention: each query attends to the index_topk tokens its
    # lightning indexer selects (0: dense MLA); index_head_dim is the width of the indexer
    # key cache the layer keeps beside its latents (0: the layer reuses another layer's
    # selection and keeps none).
    index_topk: int = 0
    index_head_dim: int = 0
    # MHA: the q/k norm + rotary the model applies before the cache (see QKRope).
    qk_rope: QKRope | None = None
    # MHA: per-head attention-sink logits [num_heads] (GPT-OSS), the model's own parameter
    # (loaded in place after the spec is built). Left out of ==: a tensor has no truth value.
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @cached_property
    def scoring(self) -> AttentionScoring:
        """The layer's scale, window, soft cap and sinks as the attention kernels take
        them; built once (every step's attention asks), the sinks tensor by reference."""
        return AttentionScoring(self.scale, self.sliding_window, self.logits_soft_cap, self.sinks)


ImplFactory = Callable[[AttentionSpec], nn.Module]
