"""Triton MLA (DeepSeek) over the latent cache [num_blocks, block_size, L + R] (atom.kernels.mla).

- write_mla_cache: the KV-write kernel, with the latent and rope halves of each cache row
  seen as a one-head key and value cache.
- decode (weight-absorbed): multi-query attention of all heads against the cache rows as
  they are (keys: L + R channels, values: their first L), split-K over the context and
  the paged-attention reduction; one program per query token, so a speculative verify
  step (the same few tokens for every sequence, each causal) runs it too. The latent tile that scores a block of keys is also its
  values, so the cache is read once per step. Bounds come from device tensors and the
  grid from static shapes, so a captured CUDA graph replays it for any lengths.
- prefill (up-projected): the prefill sequences' pages are expanded through W_UK / W_UV
  and the paged-attention prefill kernel runs with H key heads of Dn + R channels.
  Absorbed prefill would cost 2 * (L + R + L) = 2176 flops per query-key pair and head
  against 2 * (Dn + R + Dv) = 640 up-projected (V3), while the expansion is linear in the
  context, so up-projection wins for every prompt longer than a few tokens.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from atom.forward_context import AttentionMetadata
from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.mla import mla_decode_attention_torch
from atom.kernels.policy import capturable, register
from atom.kernels.triton.kv_cache import write_kv_cache_triton
from atom.kernels.triton.paged_attention import (
    _load_page_rows,
    prefill_attention,
    reduce_splits,
)

# Heads per program: every head block reads the context (after the first time, from L2),
# so wider blocks read less; ptxas (sm_90, L=512) fits 32 heads x 32 keys on 8 warps without
# spilling, while 64-head tiles get wgmma but spill; benchmarks/mla.py --sweep times the
# alternatives (and overrides this dict). Split-K aims at about two waves of programs on an
# H100's 132 SMs.
DECODE_CONFIG = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2}
TARGET_PROGRAMS = 256
MAX_SPLITS = 32

logger = logging.getLogger(__name__)


@register("write_mla_cache", "triton")
@capturable
def write_mla_cache_triton(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=1.0) -> None:
    latent_dim = kv_c.shape[-1]
    rows = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1 head, L + R]
    write_kv_cache_triton(
        kv_c.unsqueeze(1), k_pe.unsqueeze(1), rows[..., :latent_dim], rows[..., latent_dim:],
        slot_mapping, kv_scale, kv_scale,
    )  # fmt: skip


@triton.jit
def _mla_decode_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr,
    ql_stride_t, ql_stride_h, qp_stride_t, qp_stride_h, c_stride_b, c_stride_s,
    o_stride_t, o_stride_h, bt_stride, qk_scale, kv_scale, num_heads, block_size, latent_dim,
    rope_dim,
    QUERIES: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # Head blocks vary fastest, so the programs sharing a context slice run together and
    # its second and later reads hit L2.
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    query = tl.program_id(2)  # QUERIES query tokens per sequence, in sequence order
    seq = query // QUERIES
    nth = query % QUERIES
    # A sequence's query nth sees its context up to itself (causal among the new tokens).
    seq_len = tl.load(seq_lens_ptr + seq) - (QUERIES - 1 - nth)
    token = tl.load(query_start_ptr + seq).to(tl.int64) + nth
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * per_split
    split_end = tl.minimum(seq_len, split_start + per_split)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < num_heads
    ldims = tl.arange(0, BLOCK_L)
    rdims = tl.arange(0, BLOCK_R)
    lmask = ldims < latent_dim
    rmask = rdims < rope_dim
    q_latent = tl.load(
        q_latent_ptr + token * ql_stride_t + heads[:, None] * ql_stride_h + ldims[None, :],
        mask=head_valid[:, None] & lmask[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + token * qp_stride_t + heads[:, None] * qp_stride_h + rdims[None, :],
        mask=head_valid[:, None] & rmask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    for start in range(split_start, split_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_valid = n < split_end
        latent = _load_page_rows(
            cache_ptr, table_row, n, n_valid, 0, c_stride_b, c_stride_s, 0, ldims, lmask,
            block_size,
        )  # fmt: skip
        rope = _load_page_rows(
            cache_ptr + latent_dim, table_row, n, n_valid, 0, c_stride_b, c_stride_s, 0,
            rdims, rmask, block_size,
        )  # fmt: skip
        # An fp8 cache is read in the query's dtype; its scale is folded into qk_scale
        # (keys) and applied once to the output (values).
        latent = latent.to(q_latent.dtype)
        rope = rope.to(q_pe.dtype)
        s = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(rope), input_precision=PRECISION)
        s = tl.where(n_valid[None, :], s * qk_scale, float("-inf"))
        # Online softmax in the log2 domain of the paged-attention reduction; every block
        # holds a valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    acc = acc * kv_scale
    if NUM_SPLITS == 1:  # the whole context in one program: no reduction pass
        acc = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + token * o_stride_t + heads[:, None] * o_stride_h + ldims[None, :]
        tl.store(
            o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=head_valid[:, None] & lmask[None, :]
        )
    else:
        part = (query * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=head_valid)
        tl.store(part_sum_ptr + part, l_i, mask=head_valid)
        tl.store(part_out_ptr + part[:, None] * latent_dim + ldims[None, :], acc,
                 mask=head_valid[:, None] & lmask[None, :])  # fmt: skip


def _num_splits(num_decodes: int, head_blocks: int) -> int:
    programs = num_decodes * head_blocks
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, programs)))


@register("mla_decode_attention", "triton")
@capturable
def mla_decode_attention_triton(q_latent, q_pe, kv_cache, metadata, scale, out, kv_scale=1.0):
    num_decodes, num_queries = metadata.num_decodes, metadata.num_decode_tokens
    queries_per_seq = num_queries // max(num_decodes, 1)
    if num_queries != num_decodes * queries_per_seq:
        _log_uneven_queries()
        return mla_decode_attention_torch(q_latent, q_pe, kv_cache, metadata, scale, out, kv_scale)
    num_heads, latent_dim = q_latent.shape[1:]
    rope_dim = q_pe.shape[-1]
    kv_scale = kv_scale if is_fp8_kv_cache(kv_cache) else 1.0  # model-dtype caches hold x
    config = DECODE_CONFIG
    block_h = min(config["block_h"], max(16, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    num_splits = _num_splits(num_queries, head_blocks)
    if num_splits == 1:
        part_out = part_max = part_sum = out  # unused: the kernel writes `out` directly
    else:
        part_out = torch.empty(
            num_queries, num_heads, num_splits, latent_dim, dtype=torch.float32,
            device=q_latent.device,
        )  # fmt: skip
        part_max = part_out.new_empty(num_queries, num_heads, num_splits)
        part_sum = torch.empty_like(part_max)
    block_l = max(16, triton.next_power_of_2(latent_dim))
    _mla_decode_kernel[(head_blocks, num_splits, num_queries)](
        q_latent, q_pe, kv_cache, part_out, part_max, part_sum, out,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        metadata.block_table.stride(0), scale * kv_scale * math.log2(math.e), kv_scale, num_heads,
        kv_cache.shape[1], latent_dim, rope_dim,
        QUERIES=queries_per_seq, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_N=config["block_n"],
        BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    if num_splits > 1:
        # The partials are per query token, and the decode tokens lead the step.
        token_starts = metadata.query_start_loc
        if queries_per_seq > 1:
            token_starts = torch.arange(num_queries + 1, dtype=torch.int32, device=out.device)
        reduce_splits(part_out, part_max, part_sum, out, token_starts)
    return out


@functools.cache
def _log_uneven_queries() -> None:
    logger.warning(
        "MLA decode: sequences with different numbers of query tokens in one step run on "
        "the torch reference (the Triton kernel takes the same number for each)"
    )


def _prefill_pages(metadata: AttentionMetadata, block_size: int):
    """The prefill sequences' pages in order, and their block table over those pages."""
    seq_lens = metadata.seq_lens[metadata.num_decodes :]
    table = metadata.block_table[metadata.num_decodes :]
    pages_per_seq = (seq_lens + block_size - 1) // block_size
    used = torch.arange(table.shape[1], device=table.device) < pages_per_seq[:, None]
    pages = table[used].long()
    compact_table = torch.zeros_like(table)
    compact_table[used] = torch.arange(pages.shape[0], device=table.device, dtype=table.dtype)
    return pages, compact_table


@register("mla_prefill_attention", "triton")
def mla_prefill_attention_triton(
    q_nope, q_pe, kv_cache, metadata, scale, w_uk, w_uv, out, kv_scale=1.0
):
    num_heads, nope_dim, latent_dim = w_uk.shape
    block_size = kv_cache.shape[1]
    pages, compact_table = _prefill_pages(metadata, block_size)
    rows = kv_cache[pages]  # [P, block_size, L + R]
    if is_fp8_kv_cache(kv_cache):
        # The up-projection below expands these pages into per-head K/V anyway; the
        # latents are dequantized on the way (only the prefill sequences' pages).
        rows = (rows.float() * kv_scale).to(w_uk.dtype)
    kv_c, k_pe = rows[..., :latent_dim], rows[..., latent_dim:]
    page_shape = (pages.shape[0], block_size, num_heads)
    k_nope = (kv_c @ w_uk.flatten(0, 1).T).view(*page_shape, nope_dim)
    key = torch.cat([k_nope, k_pe.unsqueeze(2).expand(*page_shape, -1)], dim=-1)
    value = (kv_c @ w_uv.flatten(0, 1).T).view(*page_shape, w_uv.shape[1])
    first = metadata.num_decodes
    prefills = AttentionMetadata(
        query_start_loc=metadata.query_start_loc[first:] - metadata.num_decode_tokens,
        seq_lens=metadata.seq_lens[first:],
        block_table=compact_table,
        slot_mapping=metadata.slot_mapping[metadata.num_decode_tokens :],
        num_decodes=0,
        num_decode_tokens=0,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
    )
    query = torch.cat([q_nope, q_pe], dim=-1)
    prefill_attention(query, key, value, prefills, scale, None, None, out)
    return out
