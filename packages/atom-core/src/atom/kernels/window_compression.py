"""DeepSeek-V4's compression of the windows a step closes, over the paged caches.

A token at position p closes entry w = (p + 1) / rate - 1 when (p + 1) is a multiple of
the compressor's rate. The entry reads the kv | gate rows of its window's tokens (with
overlap, of the window before too) back from the row cache, which holds every token's,
earlier steps' included, and lands in the entry cache (atom.kernels.compressed_attention
says where). The compressor (atom.layers.kv_compressor) holds the weights and the math;
the implementations differ in how they gather the windows: the reference per sequence,
the Triton one per closing token in one launch.
"""

from __future__ import annotations

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.compressed_attention import entry_slots, rows_at, token_slots
from atom.kernels.policy import dispatch, register


@register("compress_windows", "torch")
def compress_windows_torch(compressor, row_cache, entry_cache, metadata, entry_table=None) -> None:
    rate, block_size = compressor.rate, row_cache.shape[1]
    starts = metadata.host_query_start_loc()
    for i, seq_len in enumerate(metadata.host_seq_lens()):
        context_len = seq_len - (starts[i + 1] - starts[i])
        first, last = context_len // rate, seq_len // rate
        if first == last:
            continue
        table = metadata.block_table[i]
        entries = torch.arange(first, last, device=row_cache.device)
        start = entries * rate - (compressor.span - rate)  # with overlap, the window before
        offsets = torch.arange(compressor.span, device=start.device)
        positions = (start[:, None] + offsets).clamp(min=0)
        rows = rows_at(row_cache, token_slots(table, positions, block_size))
        values = compressor.compress(rows, entries)
        entry_pages = metadata.block_table[i] if entry_table is None else entry_table[i]
        slots = entry_slots(entry_pages, entries, rate, block_size)
        per_page = entry_cache.shape[1]
        entry_cache[slots // per_page, slots % per_page] = values.to(entry_cache.dtype)


def compress_windows(
    compressor: torch.nn.Module,
    row_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    metadata: AttentionMetadata,
    entry_table: torch.Tensor | None = None,
) -> None:
    """Writes into entry_cache [num_blocks, entries_per_page, head_dim] every entry the
    step's tokens close, from row_cache [num_blocks, block_size, row_width], where the new
    tokens' rows must already be. compressor: a `KVCompressor`. The rows' pages are in
    the metadata's block table, the entries' in `entry_table` where it is given (the
    native engine's entry group)."""
    dispatch("compress_windows", row_cache.device)(
        compressor, row_cache, entry_cache, metadata, entry_table
    )
