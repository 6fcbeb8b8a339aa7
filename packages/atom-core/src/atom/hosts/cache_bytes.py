"""What one token costs in a host's KV cache, by what ATOM's MLA impls keep there.

A DeepSeek Sparse Attention layer keeps its indexer keys in the latents' pages, so a
host that sizes its pages from ATOM's row (vLLM's spec, SGLang's pool) holds fewer
tokens than for dense MLA; the plugins print the split at start-up, as the native engine
does (atom.engine.kv_layout). DeepSeek-V4's layers pack several tensors into one row per
token (atom.hosts.packed_pages): `packed_bytes_per_token` splits that row the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from atom.hosts.packed_pages import page_shapes
from atom.layers.mla_impl import NativeMLAImpl


def mla_bytes_per_token(impls: Iterable[NativeMLAImpl], dtype: torch.dtype) -> dict[str, int]:
    """Bytes per token over all `impls` by what they hold ("MLA latents", "indexer keys")."""
    element = torch.empty((), dtype=dtype).element_size()
    parts: dict[str, int] = {}
    for impl in impls:
        widths = [shape[-1] for shape in impl.kv_cache_shapes(1, 1)]
        for label, width in zip(impl.kv_cache_labels(), widths):
            parts[label] = parts.get(label, 0) + width * element
    return parts


def packed_bytes_per_token(
    impls: Iterable[torch.nn.Module], block_size: int, dtype: torch.dtype
) -> dict[str, int]:
    """Bytes per token over all `impls` (with `kv_cache_labels`) by what they hold, each
    tensor's page over the page's tokens (compressed entries: a fraction of a row)."""
    element = torch.empty((), dtype=dtype).element_size()
    parts: dict[str, int] = {}
    for impl in impls:
        for label, shape in zip(impl.kv_cache_labels(), page_shapes(impl, block_size)):
            size = -(-math.prod(shape) * element // block_size)
            parts[label] = parts.get(label, 0) + size
    return parts


def bytes_per_token_line(parts: dict[str, int]) -> str:
    """e.g. "224 B per token (160 B MLA latents + 64 B indexer keys)"."""
    split = " + ".join(f"{size} B {label}" for label, size in parts.items())
    return f"{sum(parts.values())} B per token ({split})"
