"""ATOM's impl of DeepSeek-V4's attention over the paged cache (torch reference path).

Per layer, on the sequence's block table (one set of pages, one slot mapping):

- the K = V rows of every token [num_blocks, block_size, head_dim], stored once (keys
  and values are the same tensor); queries read those of their sliding window;
- with a compressor, every token's compressor projections (kv | gate) and, for CSA
  layers, its indexer's: a window that closes in this step reads the tokens of earlier
  steps back from here, so no per-sequence state is carried and a prefix-cache hit
  serves them like any K/V;
- the compressed entries (and the indexer's), `entries_per_page` a page
  (atom.kernels.compressed_attention).

A step first writes the new tokens' rows, then compresses the windows they close, then
attends: each query over its window's K = V rows and the entries it may see (HCA: every
closed one; CSA: the indexer's top `index_topk` of them), in one softmax with the head's
sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from atom.config import ConfigError
from atom.forward_context import get_forward_context
from atom.kernels.compressed_attention import (
    entries_per_page,
    entry_slots,
    rows_at,
    select_entries,
    token_slots,
)
from atom.kernels.indexer import write_indexer_keys
from atom.kernels.paged_attention import (
    attention_mask,
    dense_attention,
    first_window_page,
    gather_pages,
)
from atom.layers.attention_spec import AttentionSpec
from atom.layers.kv_compressor import KVCompressor


@dataclass(frozen=True)
class CompressedAttentionSpec(AttentionSpec):
    """A V4 layer's spec (kind "compressed"): what a host's factory needs to build its impl
    (`atom.layers.attention.create_attention_impl`). `sliding_window` is the pages the
    layer reads (its window for a sliding-only layer, all of them, None, for a compressing
    one, whose entries reach back to the start); `window` is what its queries attend to of
    the K = V rows. The compressors are the layer's modules, by reference (their weights
    load under the layer's names)."""

    kind: str = "compressed"
    window: int = 0
    compressor: KVCompressor | None = field(default=None, compare=False)
    indexer_compressor: KVCompressor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class CompressorCache:
    """What one compressor keeps: each token's kv | gate row (`row_width`) and one entry
    of `head_dim` per `rate` tokens."""

    rate: int
    row_width: int
    head_dim: int


@dataclass(frozen=True)
class CompressedCacheLayout:
    """A layer's cache tensors from its sizes alone, so that a host can size its pool
    before any layer exists (atom.hosts.packed_pages takes it as the impl): the K = V
    rows, then per compressor (the layer's, then its indexer's) rows and entries."""

    head_dim: int
    compressors: tuple[CompressorCache, ...] = ()

    def kv_cache_labels(self) -> list[str]:
        labels = ["K=V"]
        for name in ("compressor", "indexer")[: len(self.compressors)]:
            labels += [f"{name} rows", f"{name} entries"]
        return labels

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        shapes = [(num_blocks, block_size, self.head_dim)]
        for c in self.compressors:
            shapes.append((num_blocks, block_size, c.row_width))
            shapes.append((num_blocks, entries_per_page(c.rate, block_size), c.head_dim))
        return shapes


@dataclass(frozen=True)
class IndexerInputs:
    """One step's indexer queries [T, Hi, Di] (rotated) and weights [T, Hi] (fp32, the
    scales folded in), and each token's indexer-compressor row."""

    q: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor


class CompressedAttentionImpl(nn.Module):
    """forward: q [T, H, D] and kv [T, D] rotated, each token's compressor row (or None),
    the indexer's inputs (CSA) -> [T, H, D], before the output's inverse rotation.

    The cache tensors may be views with any page stride (a host that packs them into one
    row per token, atom.hosts.packed_pages): rows are addressed by (page, row in page),
    never through a flattened copy.
    """

    cuda_graph_safe = False  # loops over sequences on the host

    def __init__(self, spec: CompressedAttentionSpec):
        super().__init__()
        self.spec = spec
        self.window = spec.window
        # The layer's modules, by reference (their weights load under the layer's names).
        self.__dict__["compressor"] = spec.compressor
        self.__dict__["indexer_compressor"] = spec.indexer_compressor
        self.index_topk = spec.index_topk
        self.caches: list[torch.Tensor] = []
        self.kv_group = 0

    @property
    def layout(self) -> CompressedCacheLayout:
        compressors = (self.compressor, self.indexer_compressor)
        return CompressedCacheLayout(
            self.spec.head_dim,
            tuple(CompressorCache(c.rate, c.row_width, c.head_dim) for c in compressors if c),
        )

    def kv_cache_labels(self) -> list[str]:
        return self.layout.kv_cache_labels()

    def kv_cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return self.layout.kv_cache_shapes(num_blocks, block_size)

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None:
        block_size = caches[0].shape[1]
        if caches[0].element_size() < 2:
            raise ConfigError(
                f"{self.spec.layer_name}: DeepSeek-V4's cache keeps compressor projections; "
                "an fp8 KV cache is not supported (kv_cache_dtype='auto')"
            )
        for compressor in (self.compressor, self.indexer_compressor):
            rate = compressor.rate if compressor is not None else 1
            if block_size % rate and rate % block_size:
                raise ConfigError(
                    f"{self.spec.layer_name}: block_size={block_size} and compress rate {rate} "
                    "must divide one another"
                )
        self.caches = list(caches)
        self.kv_group = kv_group

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        compressor_rows: torch.Tensor | None = None,
        indexer: IndexerInputs | None = None,
    ) -> torch.Tensor:
        context = get_forward_context().attn_metadata
        if context is None or not self.caches:
            raise RuntimeError(
                f"{self.spec.layer_name}: attention needs a KV cache and step metadata "
                "(run the model under atom.forward_context.set_forward_context)"
            )
        metadata = context.for_kv_group(self.kv_group)
        caches = iter(self.caches)
        kv_cache = next(caches)
        slots = metadata.slot_mapping
        write_indexer_keys(kv[: len(slots)], kv_cache, slots)
        compressed = []  # (compressor, entry cache)
        for compressor, rows in (
            (self.compressor, compressor_rows),
            (self.indexer_compressor, None if indexer is None else indexer.rows),
        ):
            if compressor is not None:
                row_cache, entry_cache = next(caches), next(caches)
                write_indexer_keys(rows[: len(slots)], row_cache, slots)
                compressed.append((compressor, row_cache, entry_cache))
        out = q.new_zeros(q.shape)
        starts = metadata.host_query_start_loc()
        for i, seq_len in enumerate(metadata.host_seq_lens()):
            begin, end = starts[i], starts[i + 1]
            if end == begin:
                continue
            table = metadata.block_table[i]
            context_len = seq_len - (end - begin)
            for compressor, row_cache, entry_cache in compressed:
                close_windows(compressor, row_cache, entry_cache, table, context_len, seq_len)
            out[begin:end] = self._attend(
                q[begin:end], kv_cache, compressed, table, context_len, seq_len,
                None if indexer is None else (indexer.q[begin:end], indexer.weights[begin:end]),
            )  # fmt: skip
        return out

    def _attend(self, q, kv_cache, compressed, table, context_len, seq_len, index_query):
        block_size = kv_cache.shape[1]
        positions = torch.arange(context_len, seq_len, device=q.device)
        first_page = first_window_page(context_len, self.window, block_size)
        keys = [gather_pages(kv_cache, table, seq_len, first_page)]
        masks = [attention_mask(positions, seq_len, self.window, first_page * block_size)]
        if compressed:
            compressor, _, entry_cache = compressed[0]
            rate = compressor.rate
            entries = torch.arange(seq_len // rate, device=q.device)
            keys.append(read_entries(entry_cache, table, entries, rate, block_size))
            visible = (positions + 1) // rate  # entry w closes at w * rate + rate - 1
            if index_query is None:  # HCA: every closed entry
                masks.append(entries[None, :] < visible[:, None])
            else:
                _, _, index_cache = compressed[1]
                index_keys = read_entries(index_cache, table, entries, rate, block_size)
                masks.append(select_entries(*index_query, index_keys, visible, self.index_topk))
        keys = torch.cat(keys).unsqueeze(1)  # one K = V head
        spec = self.spec
        return dense_attention(
            q, keys, keys, torch.cat(masks, dim=1), spec.scale, None, spec.sinks
        ).to(q.dtype)


def read_entries(
    cache: torch.Tensor, table: torch.Tensor, entries: torch.Tensor, rate: int, block_size: int
) -> torch.Tensor:
    return rows_at(cache, entry_slots(table, entries, rate, block_size))


def close_windows(
    compressor: KVCompressor,
    row_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    seq_len: int,
) -> None:
    """Compresses the windows that tokens context_len .. seq_len - 1 close, from the token
    rows in the cache (those of earlier steps included), into the entry cache."""
    rate, block_size = compressor.rate, row_cache.shape[1]
    first, last = context_len // rate, seq_len // rate
    if first == last:
        return
    entries = torch.arange(first, last, device=row_cache.device)
    start = entries * rate - (compressor.span - rate)  # with overlap, the window before
    positions = (start[:, None] + torch.arange(compressor.span, device=start.device)).clamp(min=0)
    rows = rows_at(row_cache, token_slots(table, positions, block_size))
    values = compressor.compress(rows, entries)
    slots = entry_slots(table, entries, rate, block_size)
    per_page = entry_cache.shape[1]
    entry_cache[slots // per_page, slots % per_page] = values.to(entry_cache.dtype)
