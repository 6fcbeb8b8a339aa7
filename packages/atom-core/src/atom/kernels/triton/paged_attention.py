"""Paged attention over the schema of docs/architecture.md: a split-K decode kernel with a reduction,
and the dispatch of a mixed batch (decodes here, prefills in prefill_attention.py).

GQA: the query heads that share a KV head are decoded together, so every K/V page is
read once per KV head. The kernels take their bounds from device tensors, so a captured
CUDA graph replays them for any sequence lengths.

Attention sinks (GPT-OSS): a per-head logit with no value, i.e. a key whose value is zero.
The first split starts its online-softmax state from it (running max = the sink, sum = 1),
so the reduce merges it like any key, once. With sinks the decode kernel takes 72 registers
per thread instead of 64 (H100, GPT-OSS heads; the same when the sink joins the sum at the
end): 7 blocks per SM instead of 8, so 256 sequences x 8 KV heads run in 3 waves, not 2.
Capping it at 64 (maxnreg) spilled, which cost more on the other shapes than the extra
wave does on that one (docs/performance.md, "Decode attention").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.few_queries import few_queries_as_decodes
from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.policy import register
from atom.kernels.triton.online_softmax import fold_block
from atom.kernels.triton.prefill_attention import prefill_attention

# Launch parameters, from benchmarks/tune_attention.py on an H100 (bf16, head dim 128,
# 32 q / 8 kv heads). Decode splits each sequence's keys only while there are too few
# (sequence, kv head) programs to fill the GPU: 1 split from 512 programs up (64x8k,
# 256x1k), 4 at 128 (16x8k).
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
# An fp8 cache's tile holds twice block_n keys while there are fewer programs than
# FP8_WIDE_TILE_PROGRAMS: the same bytes per load as the bf16 tile, so as many stay in
# flight; with more programs the wide tile lost occupancy (docs/performance.md, "Decode
# attention").
FP8_WIDE_TILE_PROGRAMS = 1024
DECODE_TARGET_PROGRAMS = 512
MAX_DECODE_SPLITS = 16

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_page_rows(cache_ptr, table_row_ptr, n, n_valid, head, stride_b, stride_s, stride_h,
                    dims, dim_mask, block_size):  # fmt: skip
    page = tl.load(table_row_ptr + n // block_size, mask=n_valid, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + page[:, None] * stride_b
        + (n % block_size)[:, None] * stride_s
        + head * stride_h
        + dims[None, :]
    )
    return tl.load(ptrs, mask=n_valid[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, start, kv_end, row_first, row_end,
    k_cache_ptr, v_cache_ptr, table_row, kv_head,
    k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
    dims, vdims, head_dim, v_head_dim, block_size, scale, soft_cap,
    BLOCK_N: tl.constexpr, USE_SOFT_CAP: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, ROW_BOUNDS: tl.constexpr,
):  # fmt: skip
    """Folds keys [start, start + BLOCK_N) into the online-softmax state (log2 domain).

    One query per sequence: every key before kv_end precedes it, only the ragged end is
    masked. ROW_BOUNDS (several causal queries): row r also sees only keys in
    [row_first[r], row_end[r]). FP8: the pages hold K / k_scale and V / v_scale; they widen
    to q's dtype exactly, and the scales are applied outside the loop (k_scale inside
    `scale`, v_scale at the end).
    """
    n = start + tl.arange(0, BLOCK_N)
    n_valid = n < kv_end
    k = _load_page_rows(k_cache_ptr, table_row, n, n_valid, kv_head, k_stride_b, k_stride_s,
                        k_stride_h, dims, dims < head_dim, block_size)  # fmt: skip
    if FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if USE_SOFT_CAP:
        s = s * scale
        s = soft_cap * (2 * tl.sigmoid(2 * s / soft_cap) - 1) * LOG2E  # tanh
    else:
        s = s * (scale * LOG2E)
    visible = n_valid[None, :]
    if ROW_BOUNDS:
        visible = visible & (n[None, :] >= row_first[:, None]) & (n[None, :] < row_end[:, None])
    s = tl.where(visible, s, float("-inf"))
    v = _load_page_rows(v_cache_ptr, table_row, n, n_valid, kv_head, v_stride_b, v_stride_s,
                        v_stride_h, vdims, vdims < v_head_dim, block_size)  # fmt: skip
    if FP8:
        v = v.to(q.dtype)
    return fold_block(s, v, m_i, l_i, acc, PRECISION)


# num_splits changes from step to step: specialising on it (==1, %16) would recompile
# the kernels mid-serving.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr,
    q_stride_t, q_stride_h, k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
    o_stride_t, o_stride_h,
    bt_stride, scale, soft_cap, window, group, num_q_heads, block_size, head_dim, v_head_dim,
    num_splits, sinks_ptr, v_scale, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, USE_SINKS: tl.constexpr, FP8: tl.constexpr,
    QUERIES: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, KV head, split of its keys). Its tile's rows are the
    query heads of the KV head, for each of the sequence's QUERIES causal queries (the
    last QUERIES positions): every page is read once for all of them."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - QUERIES  # the first query's position
    kv_start = 0
    if USE_WINDOW:  # no key (nor table entry) before the window is read: may be freed
        kv_start = tl.maximum(0, first_pos - window + 1)
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    split_start = kv_start + split * per_split
    split_end = tl.minimum(seq_len, split_start + per_split)

    rows = tl.arange(0, GROUP)
    query = rows // group
    head = kv_head * group + rows % group
    row_valid = rows < group * QUERIES
    token = tl.load(query_start_ptr + seq).to(tl.int64) + query
    row_end = first_pos + query + 1
    row_first = row_end * 0
    if USE_WINDOW:
        row_first = row_end - window
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_valid[:, None] & (dims < head_dim)[None, :], other=0.0)  # fmt: skip
    m_i = tl.full([GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP], tl.float32)
    if USE_SINKS:  # the sink as a first key of zero value, in the first split only
        first_split = split == 0
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0)
        m_i = tl.where(first_split, sink.to(tl.float32) * LOG2E, m_i)
        l_i = tl.where(first_split, 1.0, l_i)
    acc = tl.zeros([GROUP, BLOCK_DV], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    for start in range(split_start, split_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, start, split_end, row_first, row_end,
            k_cache_ptr, v_cache_ptr, table_row, kv_head,
            k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
            dims, vdims, head_dim, v_head_dim, block_size, scale, soft_cap,
            BLOCK_N, USE_SOFT_CAP, PRECISION, FP8, QUERIES > 1,
        )  # fmt: skip
    if FP8:
        acc = acc * v_scale
    out_mask = row_valid[:, None] & (vdims < v_head_dim)[None, :]
    if SINGLE_SPLIT:  # the state is already final: no partials, no reduce launch
        o = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h + vdims[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = ((seq * QUERIES + query) * num_q_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_out_ptr + part[:, None] * v_head_dim + vdims[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, query_start_ptr,
    o_stride_t, o_stride_h, num_q_heads, num_splits, v_head_dim,
    BLOCK_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr, QUERIES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # query `row % QUERIES` of sequence `row // QUERIES`
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_valid = splits < num_splits
    base = (row * num_q_heads + head) * num_splits
    maxes = tl.load(part_max_ptr + base + splits, mask=split_valid, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=split_valid, other=0.0)
    global_max = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - global_max))
    vdims = tl.arange(0, BLOCK_DV)
    vmask = vdims < v_head_dim
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * v_head_dim + vdims[None, :],
        mask=split_valid[:, None] & vmask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(sums * weights, 0)
    token = tl.load(query_start_ptr + row // QUERIES).to(tl.int64) + row % QUERIES
    tl.store(
        out_ptr + token * o_stride_t + head * o_stride_h + vdims,
        out.to(out_ptr.dtype.element_ty),
        mask=vmask,
    )


def reduce_splits(part_out, part_max, part_sum, out, query_start_loc, queries: int = 1) -> None:
    """Merges per-split partial softmax states [seqs x queries, heads, splits, ...] into
    `out` (`queries` causal queries per sequence, from its query_start_loc entry on).

    The split count is a runtime value (one compiled kernel for every batch size), so
    eager steps of changing decode counts never wait for a compile.
    """
    num_rows, num_heads, num_splits, v_head_dim = part_out.shape
    _decode_reduce_kernel[(num_rows, num_heads)](
        part_out, part_max, part_sum, out, query_start_loc,
        out.stride(0), out.stride(1), num_heads, num_splits, v_head_dim,
        BLOCK_SPLITS=max(MAX_DECODE_SPLITS, triton.next_power_of_2(num_splits)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)), QUERIES=queries,
    )  # fmt: skip


def _common(query, key_cache, value_cache, sliding_window, logits_soft_cap):
    num_kv_heads = key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    return dict(
        FP8=is_fp8_kv_cache(key_cache),
        window=sliding_window or 0,
        soft_cap=logits_soft_cap or 0.0,
        group=group,
        block_size=key_cache.shape[1],
        head_dim=query.shape[2],
        v_head_dim=value_cache.shape[3],
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_WINDOW=bool(sliding_window),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_D=max(16, triton.next_power_of_2(query.shape[2])),
        BLOCK_DV=max(16, triton.next_power_of_2(value_cache.shape[3])),
    )


def _cache_strides(key_cache, value_cache):
    return (
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
    )  # fmt: skip


def decode_splits(programs: int) -> int:
    wanted = triton.next_power_of_2(triton.cdiv(DECODE_TARGET_PROGRAMS, max(1, programs)))
    return min(MAX_DECODE_SPLITS, wanted)


def decode_attention(
    query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
    sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The decodes of `metadata`: num_decode_tokens // num_decodes causal queries each
    (one for a decode step, a few for a verify step: few_queries_as_decodes)."""
    num_decodes = metadata.num_decodes
    queries = metadata.num_decode_tokens // num_decodes
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    config = DECODE_CONFIG
    num_splits = config.get("num_splits") or decode_splits(num_decodes * num_kv_heads)
    args = _common(query, key_cache, value_cache, sliding_window, logits_soft_cap)
    v_head_dim = args["v_head_dim"]
    single = num_splits == 1
    # Large batches fill the GPU with one split per (sequence, kv head): the kernel then
    # writes the output itself, sparing the reduce pass (docs/performance.md, "Decode
    # attention").
    part_shape = (0, 0, 0) if single else (num_decodes * queries, num_q_heads, num_splits)
    part_out = query.new_empty(*part_shape, v_head_dim, dtype=torch.float32)
    part_max = query.new_empty(part_shape, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    group_block = max(16, triton.next_power_of_2(args["group"] * queries))
    programs = num_decodes * num_kv_heads * num_splits
    wide = args["FP8"] and programs < FP8_WIDE_TILE_PROGRAMS
    block_n = config["block_n"] * (2 if wide else 1)
    _decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, key_cache, value_cache, part_out, part_max, part_sum, out,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        query.stride(0), query.stride(1), *_cache_strides(key_cache, value_cache),
        out.stride(0), out.stride(1),
        metadata.block_table.stride(0), scale * k_scale if args["FP8"] else scale, args["soft_cap"], args["window"], args["group"],
        num_q_heads, args["block_size"], args["head_dim"], v_head_dim,
        num_splits, query if sinks is None else sinks, v_scale, GROUP=group_block, BLOCK_N=block_n,
        BLOCK_D=args["BLOCK_D"], BLOCK_DV=args["BLOCK_DV"],
        USE_SOFT_CAP=args["USE_SOFT_CAP"], USE_WINDOW=args["USE_WINDOW"], PRECISION=args["PRECISION"],
        SINGLE_SPLIT=single, USE_SINKS=sinks is not None, FP8=args["FP8"], QUERIES=queries,
        num_warps=config["num_warps"] * (2 if group_block > 32 else 1),
        num_stages=config["num_stages"],
    )  # fmt: skip
    if not single:
        reduce_splits(part_out, part_max, part_sum, out, metadata.query_start_loc, queries)


@register("paged_attention", "triton")
def paged_attention_triton(
    query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
    key=None, value=None, sinks=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """key/value: the step's new K/V [T, Hkv, D] (see atom.kernels.paged_attention); the
    prefill kernel reads the new tokens' keys from them instead of the pages. A step of
    the same few tokens per sequence (a speculative verify step) runs as decodes of that
    many queries (atom.kernels.few_queries).
    sinks: [Hq] attention-sink logits, or None. k_scale / v_scale: an fp8 cache's scales."""
    metadata = few_queries_as_decodes(metadata)
    if metadata.num_decodes:
        decode_attention(
            query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
            sinks, k_scale, v_scale,
        )  # fmt: skip
    if metadata.num_seqs > metadata.num_decodes:
        prefill_attention(
            query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
            key, value, sinks, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return out
