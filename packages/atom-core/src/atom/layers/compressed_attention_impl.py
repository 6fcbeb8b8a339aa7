"""ATOM's impl of DeepSeek-V4's attention over the paged cache.

Per layer, on the sequence's pages:

- the K = V rows of every token [num_blocks, block_size, head_dim], stored once (keys
  and values are the same tensor); queries read those of their sliding window;
- with a compressor, every token's compressor projections (kv | gate) and, for CSA
  layers, its indexer's: a window that closes in this step reads the tokens of earlier
  steps back from here, so no per-sequence state is carried and a prefix-cache hit
  serves them like any K/V;
- the compressed entries (and the indexer's), `entries_per_page` a page
  (atom.kernels.compressed_attention).

Hosts bind all of them on one block table (`bind_kv_cache`). The native engine splits
them (`kv_cache_parts`): the rows are read only within `rows_reach` tokens of a query, so
they go to a sliding-window KV-cache group whose pages are freed as the window passes; the
entries, read back to the start, to a full-history group of their own page shape. The
impl then reads each through its group's table (`AttentionMetadata.for_kv_group`).

A step first writes the new tokens' rows, then compresses the windows they close
(atom.kernels.window_compression), then attends: each query over its window's K = V rows
and the entries it may see (HCA: every closed one; CSA: the indexer's top `index_topk` of
them), in one softmax with the head's sink. Each of those is a kernel-policy op: on a GPU
Triton runs the whole batch in one launch per op, with no host sync, so a step can be
captured in a CUDA graph (`cuda_graph_safe`); on the CPU the torch references loop over the
sequences. A captured batch is padded with sequences of one token at position 0 that
write nowhere (slot -1): they close no window (every rate is 2 or more), see no entry and
read one row of their first page.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from atom.config import ConfigError
from atom.forward_context import get_forward_context
from atom.kernels.compressed_attention import (
    compressed_attention,
    compressed_entry_topk,
    entries_per_page,
)
from atom.kernels.indexer import write_indexer_keys
from atom.kernels.policy import is_capturable, selected_backend
from atom.kernels.window_compression import compress_windows
from atom.layers.attention_spec import AttentionSpec
from atom.layers.kv_cache_part import KVCachePart
from atom.layers.kv_compressor import KVCompressor

logger = logging.getLogger(__name__)

# The ops of a step, in the order it runs them.
STEP_OPS = (
    "write_indexer_keys",
    "compress_windows",
    "compressed_entry_topk",
    "compressed_attention",
)


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

    def entry_tensors(self) -> list[int]:
        """Which of kv_cache_shapes' tensors hold entries (the others: per-token rows)."""
        return [2 + 2 * i for i in range(len(self.compressors))]


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

    def __init__(self, spec: CompressedAttentionSpec):
        super().__init__()
        self.spec = spec
        self.window = spec.window
        # The layer's modules, by reference (their weights load under the layer's names).
        self.__dict__["compressor"] = spec.compressor
        self.__dict__["indexer_compressor"] = spec.indexer_compressor
        self.index_topk = spec.index_topk
        self.caches: list[torch.Tensor | None] = []
        self.kv_group = 0  # the rows' group (a host's: every tensor's)
        # The entries' group where the engine keeps them apart (kv_cache_parts); None:
        # kv_group's, as a host binds them.
        self.entry_group: int | None = None

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a step can be captured in a CUDA graph on the layer's device: its ops'
        Triton kernels take every bound from device tensors and the step's tokens from the
        slot mapping's length, the torch references loop over host-side sequence lengths.
        The ops are the same for any number of tokens per sequence."""
        device = self.spec.sinks.device
        return all(is_capturable(op, device) for op in STEP_OPS)

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

    @property
    def rows_reach(self) -> int:
        """How many tokens back from a query (itself included) a step reads rows: its
        window's K = V rows, and each compressor's span (the token that closes a window
        reads the window's projection rows, with overlap the window's before too)."""
        compressors = (self.compressor, self.indexer_compressor)
        return max([self.window, *(c.span for c in compressors if c is not None)])

    def kv_cache_parts(self) -> list[KVCachePart]:
        """The native engine's split (atom.engine.kv_groups): the per-token rows, read
        within `rows_reach` tokens of a query, and the entries, read back to the start."""
        entries = self.layout.entry_tensors()
        rows = [i for i in range(len(self.kv_cache_labels())) if i not in entries]
        parts = [KVCachePart(self, rows, self.rows_reach, self._bind_rows)]
        if entries:
            parts.append(KVCachePart(self, entries, None, self._bind_entries))
        return parts

    def bind_kv_cache(self, caches: Sequence[torch.Tensor], kv_group: int = 0) -> None:
        self._check_rows(caches[0])
        self.caches = list(caches)
        self.kv_group = kv_group
        self.entry_group = None

    def _bind_rows(self, indices: tuple[int, ...], caches: list[torch.Tensor], group: int) -> None:
        self._check_rows(caches[0])
        self._place(indices, caches)
        self.kv_group = group

    def _bind_entries(
        self, indices: tuple[int, ...], caches: list[torch.Tensor], group: int
    ) -> None:
        self._place(indices, caches)
        self.entry_group = group

    def _place(self, indices: tuple[int, ...], caches: list[torch.Tensor]) -> None:
        if len(self.caches) != len(self.kv_cache_labels()):
            self.caches = [None] * len(self.kv_cache_labels())
        for i, cache in zip(indices, caches, strict=True):
            self.caches[i] = cache

    def _check_rows(self, kv_cache: torch.Tensor) -> None:
        block_size = kv_cache.shape[1]
        if kv_cache.element_size() < 2:
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
        say_where_torch_runs(kv_cache.device)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        compressor_rows: torch.Tensor | None = None,
        indexer: IndexerInputs | None = None,
    ) -> torch.Tensor:
        context = get_forward_context().attn_metadata
        if context is None or not self.caches or any(c is None for c in self.caches):
            raise RuntimeError(
                f"{self.spec.layer_name}: attention needs a KV cache and step metadata "
                "(run the model under atom.forward_context.set_forward_context)"
            )
        metadata = context.for_kv_group(self.kv_group)
        entry_group = self.kv_group if self.entry_group is None else self.entry_group
        entry_metadata = context.for_kv_group(entry_group)
        entry_table = entry_metadata.block_table
        # A host may pad the batch past its metadata's tokens (vLLM's CUDA-graph batches):
        # those rows write nothing and attend to nothing.
        n = metadata.num_tokens
        caches = iter(self.caches)
        kv_cache = next(caches)
        write_indexer_keys(kv[:n], kv_cache, metadata.slot_mapping)
        entry_caches = []
        for compressor, rows in (
            (self.compressor, compressor_rows),
            (self.indexer_compressor, None if indexer is None else indexer.rows),
        ):
            if compressor is not None:
                row_cache, entry_cache = next(caches), next(caches)
                write_indexer_keys(rows[:n], row_cache, metadata.slot_mapping)
                compress_windows(compressor, row_cache, entry_cache, metadata, entry_table)
                entry_caches.append(entry_cache)
        chosen = None
        if indexer is not None:
            chosen = compressed_entry_topk(
                indexer.q[:n], indexer.weights[:n], entry_caches[1], entry_metadata,
                self.indexer_compressor.rate, kv_cache.shape[1], self.index_topk,
            )  # fmt: skip
        spec = self.spec
        rate = 0 if self.compressor is None else self.compressor.rate
        out = q.new_zeros(q.shape)
        compressed_attention(
            q[:n], kv_cache, metadata, self.window, spec.scale, spec.sinks,
            entry_caches[0] if entry_caches else None, rate, chosen, out=out[:n],
            entry_table=entry_table,
        )  # fmt: skip
        return out


@functools.cache
def say_where_torch_runs(device: torch.device) -> None:
    """One line per device where a step op falls back to its torch reference on a GPU
    (ATOM_KERNELS=torch, or no Triton): that route loops over the sequences on the host."""
    if device.type != "cuda":
        return
    torch_ops = [op for op in STEP_OPS if selected_backend(op, device) == "torch"]
    if torch_ops:
        logger.info(
            "DeepSeek-V4 attention on %s runs the torch reference of %s (a loop over the "
            "sequences, with host syncs)", device, ", ".join(torch_ops),
        )  # fmt: skip
