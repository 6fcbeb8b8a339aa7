"""The impl module ATOM's attention layers get inside vLLM: vLLM's `Attention` layer.

The wrapper builds the ATOM model inside `atom.layers.attention.attention_backend(
factory)`; for every ATOM `Attention` the factory returns a `VllmAttention`, which owns
a vLLM `Attention` layer constructed with `AtomAttentionBackend`. vLLM therefore sees an
ordinary attention layer named after ATOM's layer (`model.layers.N.self_attn.attn`):
it sizes, allocates and binds its KV cache, builds the step metadata and calls the
backend's impl. MLA layers (spec.kind == "MLA") get `atom_vllm.mla.VllmMLAAttention`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention

from atom.layers.attention_spec import AttentionSpec, ImplFactory
from atom_vllm.attention import AtomAttentionBackend


class VllmAttention(nn.Module):
    """ATOM impl contract: (q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv]) -> [T,Hq,Dv], with raw
    q/k and `positions=` for a layer with `spec.qk_rope` (AtomAttentionImpl fuses it)."""

    fuses_qk_rope = True

    def __init__(self, spec: AttentionSpec, cache_config: Any):
        super().__init__()
        self.spec = spec
        self.attn = Attention(
            spec.num_heads,
            spec.head_dim,
            spec.scale,
            num_kv_heads=spec.num_kv_heads,
            cache_config=cache_config,
            logits_soft_cap=spec.logits_soft_cap,
            per_layer_sliding_window=spec.sliding_window,
            prefix=spec.layer_name,
            attn_backend=AtomAttentionBackend,
            head_size_v=spec.v_head_dim if spec.v_head_dim != spec.head_dim else None,
            qk_rope=spec.qk_rope,
        )
        if spec.sliding_window is None and self.attn.sliding_window is not None:
            # vLLM falls back to the model-wide window; ATOM's spec is per layer and
            # says this layer attends to everything.
            self.attn.sliding_window = None
            self.attn.impl.sliding_window = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spec = self.spec
        # vLLM's op carries only q, k, v: the impl takes this step's positions from its
        # metadata (vLLM's CommonAttentionMetadata.positions), the same tensor as these.
        out = self.attn(q, k, v)
        return out.view(-1, spec.num_heads, spec.v_head_dim)

    def extra_repr(self) -> str:
        return f"layer={self.spec.layer_name!r}, backend=AtomAttentionBackend"


def vllm_attention_factory(vllm_config: Any) -> ImplFactory:
    """The factory `attention_backend(...)` takes, for one vLLM model instance."""
    cache_config = vllm_config.cache_config

    def factory(spec: AttentionSpec) -> nn.Module:
        if spec.kind == "MLA":
            from atom_vllm.mla import VllmMLAAttention

            return VllmMLAAttention(spec, vllm_config)
        return VllmAttention(spec, cache_config)

    return factory
