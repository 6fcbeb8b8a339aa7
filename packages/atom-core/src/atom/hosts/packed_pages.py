"""One row per token for an impl whose cache tensors have different shapes per page.

A host like vLLM sizes a layer's cache as pages of `block_size` rows of one width (its
KV-cache spec's head size) and hands the layer `[num_blocks, block_size, width]`.
DeepSeek-V4's layer keeps per page tensors of other shapes: K = V rows and compressor
projections per token, but its compressed entries per window (`block_size / rate` of
them, at least one, atom.kernels.compressed_attention). So the host's row is made wide
enough that one page of rows holds one page of every tensor, and each tensor is a view of
its part of each page: same block table, same slot mapping, pages shared by prefix hits
and freed with the request, as natively.

The impl's tensors are then views whose pages are not adjacent (the page stride is the
host's); `CompressedAttentionImpl` addresses rows by (page, row in page), never through a
flattened copy.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class PagedCacheShapes(Protocol):
    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]: ...


def page_shapes(impl: PagedCacheShapes, block_size: int) -> list[tuple[int, ...]]:
    """The shape of one page of each of the impl's cache tensors."""
    return [tuple(shape[1:]) for shape in impl.kv_cache_shapes(1, block_size)]


def packed_row_width(impl: PagedCacheShapes, block_size: int) -> int:
    """Elements per token of a row wide enough that a page of `block_size` rows holds one
    page of each of the impl's tensors."""
    elements = sum(math.prod(shape) for shape in page_shapes(impl, block_size))
    return -(-elements // block_size)


def unpack_pages(rows: torch.Tensor, impl: PagedCacheShapes) -> list[torch.Tensor]:
    """The host's `[num_blocks, block_size, width]` cache -> the impl's tensors, each
    `[num_blocks, *page shape]`, views of consecutive parts of every page. A page's rows
    must be adjacent in memory (the view refuses otherwise, rather than copying)."""
    num_blocks, block_size, width = rows.shape
    if width < packed_row_width(impl, block_size):
        raise ValueError(
            f"a row of {width} elements is narrower than the impl's "
            f"{packed_row_width(impl, block_size)} per token"
        )
    pages = rows.view(num_blocks, block_size * width)
    views: list[torch.Tensor] = []
    offset = 0
    for shape in page_shapes(impl, block_size):
        size = math.prod(shape)
        views.append(pages[:, offset : offset + size].unflatten(1, shape))
        offset += size
    return views
