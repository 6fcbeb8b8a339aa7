"""ATOM's own AttentionImpl: write the new K/V into the paged cache, then one kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from atom.forward_context import AttentionMetadata, get_forward_context
from atom.kernels import PagedKVCache, paged_attention, write_kv_cache
from atom.layers.attention_spec import AttentionSpec


def write_kv_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    metadata: AttentionMetadata,
    spec: AttentionSpec,
    positions: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The step of every MHA impl on ATOM's cache layout (native, vLLM, SGLang): K/V into
    the paged cache, then paged attention, which also gets the new K/V as dense rows (the
    prefill kernel reads the new tokens' keys from them).

    q and k are raw: with `spec.qk_rope` they are normalised and rotated in the kernel
    that writes the cache (k is left rotated, in place), which needs `positions`. This is
    the one place that decides it. slot_mapping may be shorter than q (host padding):
    only its tokens count."""
    slots = metadata.slot_mapping
    n = slots.shape[0]
    if spec.qk_rope is not None:
        if positions is None:
            raise ValueError(f"{spec.layer_name}: q/k rotary needs the tokens' positions")
        q = spec.qk_rope.apply_and_write_kv(
            positions, q, k, v, cache.key, cache.value, slots, cache.k_scale, cache.v_scale
        )
    else:
        write_kv_cache(
            k[:n], v[:n], cache.key, cache.value, slots,
            k_scale=cache.k_scale, v_scale=cache.v_scale,
        )  # fmt: skip
    return paged_attention(q, cache, metadata, spec.scoring, out=out, new_kv=(k[:n], v[:n]))


class NativeAttentionImpl(nn.Module):
    """KV cache layout: key/value [num_blocks, block_size, num_kv_heads, head_dim].

    The engine binds the caches with `bind_kv_cache` after it has sized the pool, and
    with them the layer's KV-cache group: the layer reads that group's block table and
    slot mapping from the step's metadata (AttentionMetadata.for_kv_group). With an fp8
    cache, k_scale / v_scale are the layer's per-tensor scales: the checkpoint's
    (atom.loader sets them while loading), 1.0 where it has none.
    """

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        s = self.spec
        return [
            (num_blocks, block_size, s.num_kv_heads, s.head_dim),
            (num_blocks, block_size, s.num_kv_heads, s.v_head_dim),
        ]

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None:
        self.key_cache, self.value_cache = caches
        self.kv_group = kv_group

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if metadata is None or self.key_cache is None:
            raise RuntimeError(
                f"{self.spec.layer_name}: attention needs a KV cache and step metadata "
                "(run the model under atom.forward_context.set_forward_context)"
            )
        cache = PagedKVCache(self.key_cache, self.value_cache, self.k_scale, self.v_scale)
        return write_kv_and_attend(
            q, k, v, cache, metadata.for_kv_group(self.kv_group), self.spec, positions
        )
