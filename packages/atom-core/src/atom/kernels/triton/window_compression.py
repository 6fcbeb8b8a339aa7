"""Triton compression of the windows a step closes (atom.kernels.window_compression).

One launch over all the step's tokens: a program per (token, block of channels) returns
at once unless its token closes a window; otherwise it reads the window's kv | gate rows
(with overlap the previous window's too) through the block table and writes their gated
sum (`KVCompressor.pool`: softmax over the window of gate + position bias, per channel).
The compressor's norm and rope then run over every token's row, and the entries are
written at the slots of the tokens that close one (-1 for the rest), in the pages of the
entries' table (`entry_table`, the rows' by default). Every bound comes
from device tensors (`AttentionMetadata.query_token_bounds`): no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.indexer import write_indexer_keys
from atom.kernels.policy import capturable, register
from atom.kernels.triton.paged_attention import _load_page_rows

# Elements of a [rate, channels] tile: HCA's 128-token windows take 32 channels a program,
# CSA's 4-token ones all of a 512-channel head.
TILE_ELEMENTS = 4096


@triton.jit
def _window_part(rows_ptr, ape_ptr, table_row, positions, valid, channel, dims, dim_valid,
                 r_stride_b, r_stride_s, ape_stride, width, block_size, RATE: tl.constexpr):  # fmt: skip
    """kv and gate + position bias [RATE, BLOCK_D] of one window's tokens, channels
    channel + dims of the kv | gate row (gate -inf where not valid)."""
    kv = _load_page_rows(rows_ptr + channel, table_row, positions, valid, 0, r_stride_b,
                         r_stride_s, 0, dims, dim_valid, block_size).to(tl.float32)  # fmt: skip
    gate = _load_page_rows(rows_ptr + width + channel, table_row, positions, valid, 0,
                           r_stride_b, r_stride_s, 0, dims, dim_valid, block_size)  # fmt: skip
    slots = tl.arange(0, RATE)
    bias = tl.load(ape_ptr + slots[:, None] * ape_stride + channel + dims[None, :],
                   mask=dim_valid[None, :], other=0.0)  # fmt: skip
    gate = tl.where(valid[:, None], gate.to(tl.float32) + bias, float("-inf"))
    return kv, gate


@triton.jit
def _pool_windows_kernel(
    rows_ptr, ape_ptr, pooled_ptr, block_table_ptr, token_seq_ptr, token_keys_ptr,
    r_stride_b, r_stride_s, ape_stride, p_stride_t, bt_stride, head_dim, width, block_size,
    RATE: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    num_keys = tl.load(token_keys_ptr + token)  # position + 1; 0 for a host's padding
    if (num_keys == 0) | (num_keys % RATE != 0):
        return
    entry = num_keys // RATE - 1
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    table_row = block_table_ptr + tl.load(token_seq_ptr + token).to(tl.int64) * bt_stride
    positions = entry * RATE + tl.arange(0, RATE)
    # With overlap a token's row is Ca | Cb (each head_dim) for kv and for gate: its
    # window's entry takes the Cb half, the next window's the Ca half.
    own = head_dim if OVERLAP else 0
    kv, gate = _window_part(rows_ptr, ape_ptr, table_row, positions, positions >= 0, own,
                            dims, dim_valid, r_stride_b, r_stride_s, ape_stride, width,
                            block_size, RATE)  # fmt: skip
    top = tl.max(gate, 0)
    if OVERLAP:  # entry 0 has no window before it: those slots weigh nothing
        before = positions - RATE
        kv_before, gate_before = _window_part(
            rows_ptr, ape_ptr, table_row, before, before >= 0, 0, dims, dim_valid,
            r_stride_b, r_stride_s, ape_stride, width, block_size, RATE,
        )  # fmt: skip
        top = tl.maximum(top, tl.max(gate_before, 0))
    weight = tl.exp(gate - top[None, :])
    total = tl.sum(weight, 0)
    pooled = tl.sum(kv * weight, 0)
    if OVERLAP:
        weight_before = tl.exp(gate_before - top[None, :])
        total += tl.sum(weight_before, 0)
        pooled += tl.sum(kv_before * weight_before, 0)
    out = pooled / total
    tl.store(pooled_ptr + token * p_stride_t + dims, out.to(pooled_ptr.dtype.element_ty),
             mask=dim_valid)  # fmt: skip


@register("compress_windows", "triton")
@capturable
def compress_windows_triton(compressor, row_cache, entry_cache, metadata, entry_table=None) -> None:
    num_tokens = metadata.num_tokens
    if num_tokens == 0:
        return
    token_seq, token_keys = metadata.query_token_bounds
    rate, head_dim, block_size = compressor.rate, compressor.head_dim, row_cache.shape[1]
    pooled = torch.zeros(num_tokens, head_dim, dtype=row_cache.dtype, device=row_cache.device)
    block_d = min(triton.next_power_of_2(head_dim), max(16, TILE_ELEMENTS // rate))
    ape = compressor.ape
    _pool_windows_kernel[(num_tokens, triton.cdiv(head_dim, block_d))](
        row_cache, ape, pooled, metadata.block_table, token_seq, token_keys,
        row_cache.stride(0), row_cache.stride(1), ape.stride(0), pooled.stride(0),
        metadata.block_table.stride(0), head_dim, ape.shape[1], block_size,
        RATE=rate, OVERLAP=compressor.overlap, BLOCK_D=block_d,
    )  # fmt: skip
    closes = (token_keys > 0) & (token_keys % rate == 0)
    entries = (token_keys // rate - 1).clamp(min=0).long()
    values = compressor.finish(pooled, entries)
    # An entry lives in the page of the token that closes it (atom.kernels.compressed_attention).
    positions = (token_keys.long() - 1).clamp(min=0)
    entry_table = metadata.block_table if entry_table is None else entry_table
    pages = entry_table[token_seq.long(), positions // block_size].long()
    per_page = entry_cache.shape[1]
    slots = torch.where(closes, pages * per_page + entries % per_page, -1)
    write_indexer_keys(values, entry_cache, slots)
