"""Some of an impl's cache tensors that keep the same pages of a sequence.

An engine that frees pages as a window passes (the native one, atom.engine.kv_groups)
groups the layers by the pages they read. Most impls read all their tensors alike; one
whose tensors reach back differently splits them into parts, each grouped on its own:
DeepSeek-V4's per-token rows are read only within a window of the query, its compressed
entries back to the start (`CompressedAttentionImpl.kv_cache_parts`). A part looks to the
engine like an impl of its own (shapes, labels, binding with its group); hosts that bind
an impl's tensors all at once (vLLM, SGLang) never see it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class KVCachePart:
    """Tensors `indices` of `impl`'s `kv_cache_shapes`, which read the pages of the last
    `sliding_window` tokens before a query (None: every page); `bind(indices, tensors,
    kv_group)` gives the impl their tensors and their KV-cache group."""

    def __init__(
        self,
        impl,
        indices: Sequence[int],
        sliding_window: int | None,
        bind: Callable[[tuple[int, ...], list[torch.Tensor], int], None],
    ):
        self.impl = impl
        self.indices = tuple(indices)
        self.sliding_window = sliding_window
        self._bind = bind

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        shapes = self.impl.kv_cache_shapes(num_blocks, block_size)
        return [shapes[i] for i in self.indices]

    def kv_cache_labels(self) -> list[str]:
        labels = self.impl.kv_cache_labels()
        return [labels[i] for i in self.indices]

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None:
        self._bind(self.indices, list(caches), kv_group)
