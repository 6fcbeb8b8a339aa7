"""ATOM's own AttentionImpl: write the new K/V into the paged cache, then one kernel."""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import AttentionMetadata, get_forward_context
from atom.kernels import paged_attention, write_kv_cache
from atom.layers.attention_spec import AttentionSpec, QKRope


def write_kv_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    qk_rope: QKRope | None = None,
    positions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The step of every impl on ATOM's cache layout (native, vLLM, SGLang): K/V into the
    paged cache, then paged attention, which also gets the new K/V as dense rows (the
    prefill kernel reads the new tokens' keys from them). With `positions`, q and k are
    raw, `qk_rope` is applied in the same kernel as the KV write, and k is left rotated
    (in place). slot_mapping may be shorter than q (host padding): only its tokens count.
    k_scale / v_scale: an fp8 cache's per-tensor scales (atom.kernels.kv_cache)."""
    slots = metadata.slot_mapping
    n = slots.shape[0]
    if positions is not None:
        q = qk_rope.apply_and_write_kv(
            positions, q, k, v, key_cache, value_cache, slots, k_scale, v_scale
        )
    else:
        write_kv_cache(
            k[:n], v[:n], key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale
        )
    return paged_attention(
        q,
        key_cache,
        value_cache,
        metadata,
        scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        out=out,
        key=k[:n],
        value=v[:n],
        k_scale=k_scale,
        v_scale=v_scale,
    )


class NativeAttentionImpl(nn.Module):
    """KV cache layout: key/value [num_blocks, block_size, num_kv_heads, head_dim].

    The engine binds the caches with `bind_kv_cache` after it has sized the pool, and
    with them the layer's KV-cache group: the layer reads that group's block table and
    slot mapping from the step's metadata (AttentionMetadata.for_kv_group). With an fp8
    cache, k_scale / v_scale are the layer's per-tensor scales: the checkpoint's
    (atom.loader sets them while loading), 1.0 where it has none.
    """

    fuses_qk_rope = True

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

    def bind_kv_cache(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, kv_group: int = 0
    ) -> None:
        self.key_cache, self.value_cache = key_cache, value_cache
        self.kv_group = kv_group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if metadata is None or self.key_cache is None:
            raise RuntimeError(
                f"{self.spec.layer_name}: attention needs a KV cache and step metadata "
                "(run the model under atom.forward_context.set_forward_context)"
            )
        return write_kv_and_attend(
            q,
            k,
            v,
            self.key_cache,
            self.value_cache,
            metadata.for_kv_group(self.kv_group),
            self.spec.scale,
            sliding_window=self.spec.sliding_window,
            logits_soft_cap=self.spec.logits_soft_cap,
            sinks=self.spec.sinks,
            qk_rope=self.spec.qk_rope,
            positions=positions,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
