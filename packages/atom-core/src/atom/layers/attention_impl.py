"""The contract between ATOM's attention layers and the impls a host supplies.

A layer (`atom.layers.attention.Attention`, `atom.layers.mla.MultiHeadLatentAttention`)
builds its `AttentionSpec` and asks the current host's factory for an impl of it
(`atom.layers.attention.attention_backend`). The impl keeps a reference to that spec and
reads window, soft cap, sinks, q/k rope and scale from it at run time; it reads the step
from ATOM's forward context (`get_forward_context().attn_metadata`), which every host's
bridge fills with one complete `AttentionMetadata` (docs/architecture.md), or, where the
host's own attention backend runs the step, with that step's `host_attention`.

The native impls (`paged_attention_impl`, `mla_impl`) and every plugin's impls satisfy
these protocols; a test checks each class against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from atom.layers.attention_spec import AttentionSpec


@runtime_checkable
class AttentionImpl(Protocol):
    """MHA / GQA over a paged KV cache.

    forward: q [T, Hq, D] and k [T, Hkv, D] as the model projected them, v [T, Hkv, Dv],
    positions [T] -> [T, Hq, Dv]. q and k are raw: the impl applies `spec.qk_rope` (when
    the spec has one) itself, fused with its KV-cache write
    (`atom.layers.paged_attention_impl.write_kv_and_attend` decides that, in one place).
    """

    spec: AttentionSpec

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor: ...


@runtime_checkable
class MLAImpl(Protocol):
    """Multi-head latent attention over a paged latent cache.

    forward: q_nope [T, H, Dn], q_pe [T, H, R] (rotated), kv_c [T, L] (normalised latent),
    k_pe [T, R] (rotated) -> [T, H, Dv]. W_UK / W_UV come from `spec.kv_b_proj` once its
    weights are loaded (`atom.layers.mla_impl.NativeMLAImpl`, which every host's MLA impl
    composes, splits them in its `process_weights_after_loading`).
    """

    spec: AttentionSpec

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class SparseMLAImpl(Protocol):
    """The DeepSeek Sparse Attention part of an MLA impl whose spec has `index_topk`.

    select_tokens: the step's indexer inputs (`atom.layers.indexer.IndexerQuery`) ->
    each token's top-k cache slots [T, topk] (-1: none); the impl writes the indexer keys
    into the key cache it keeps beside the latents. attend_selected: forward's inputs and
    those slots -> [T, H, Dv], attending only to the selected tokens.
    """

    def select_tokens(self, index: Any) -> torch.Tensor: ...

    def attend_selected(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        topk_slots: torch.Tensor,
    ) -> torch.Tensor: ...


@runtime_checkable
class PagedCacheOwner(Protocol):
    """An impl whose cache tensors its engine allocates and binds.

    `kv_cache_shapes` lists the tensors of one layer; `bind_kv_cache` takes them in that
    order with the layer's KV-cache group (the index of its block table and slot mapping
    in the step's metadata, `AttentionMetadata.for_kv_group`).
    """

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]: ...

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None: ...
