"""Causal varlen prefill over the paged KV cache (docs/architecture.md): one program per
(query head, prefill sequence, tile of BLOCK_M new tokens).

A sequence's keys come from two places:
- its cached prefix (positions below context = seq_len - query_len): the pages, one
  table entry per page; a [pages, rows, D] block is loaded and reshaped to [BLOCK_N, D]
  (faster than a table lookup per key row: docs/performance.md, "Prefill attention");
- its new tokens: the step's dense `key`/`value` [T, Hkv, D] when the caller passes them
  (every host has them: it has just written them into the cache), read through TMA
  descriptors on Hopper and newer; without them, the pages as well.
Tiles hold one query head: GQA-packed tiles (all heads of a KV head) ran no faster
(docs/performance.md, "Prefill attention"), and their shape would follow the group size.
Key blocks below a tile's first query are visible to all its rows and skip the mask;
only the diagonal blocks (and, with a sliding window, every block) pay for it. That is a
runtime check inside one loop per source: with an unmasked loop and a masked loop the
pipeline drained and refilled at the diagonal (the A/B: docs/performance.md, "Prefill
attention").
An attention sink (GPT-OSS: a per-head logit with no value) is a key of zero value: the
online softmax starts from it (running max = the sink, sum = 1), outside the key loops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.kv_cache import is_fp8_kv_cache
from atom.kernels.triton.tma import tma_ready, tma_supported, use_scratch_allocator

# Launch parameters from H200 sweeps (benchmarks/tune_attention.py; bf16, head dim 128,
# 32 q / 8 kv heads, 16-token pages, new K/V dense through TMA); how they compare with FA3:
# docs/performance.md, "Prefill attention".
LONG_CONFIG = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tma": True}
SHORT_CONFIG = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2, "tma": True}
LONG_TOKENS = 1024
# fp32 and heads wider than 128 need smaller tiles to fit shared memory; MLA's latent
# heads (576 channels, padded to 1024) the smallest that tl.dot takes.
WIDE_CONFIG = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2, "tma": True}
HUGE_CONFIG = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False}

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load(ptrs, rows_ok, dims_ok, MASK_DIMS: tl.constexpr):
    if MASK_DIMS:
        return tl.load(ptrs, mask=rows_ok & dims_ok, other=0.0)
    return tl.load(ptrs, mask=rows_ok, other=0.0)


@triton.jit
def _page_rows(cache_ptr, table_row, start, begin, end, page_stride, slot_stride, dims, dims_ok,
               MASK_DIMS: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SKIP_BEFORE: tl.constexpr):  # fmt: skip
    """Keys [start, start + BLOCK_N) of one KV head from the sequence's pages: [BLOCK_N, D].

    PAGE_ROWS > 0: start is page aligned (or BLOCK_N-aligned inside a page), and each page
    gives PAGE_ROWS consecutive rows. PAGE_ROWS == 0 (a page size that neither divides nor
    is divided by BLOCK_N): one table lookup per row. Rows at or past `end` read zeros
    (their table entries and pages may be anything). SKIP_BEFORE: so do rows before
    `begin`, and their table entries are not read (a sliding window's freed pages).
    """
    if PAGE_ROWS > 0:
        PAGES: tl.constexpr = BLOCK_N // PAGE_ROWS
        page_index = tl.arange(0, PAGES)
        slots = tl.arange(0, PAGE_ROWS)
        n = start + page_index[:, None] * PAGE_ROWS + slots[None, :]
        first = start + page_index * PAGE_ROWS
        page_ok = first < end
        rows_ok = n < end
        if SKIP_BEFORE:
            page_ok &= first + PAGE_ROWS > begin
            rows_ok &= n >= begin
        pages = tl.load(table_row + first // PAGE_SIZE, mask=page_ok, other=0)
        ptrs = (
            cache_ptr
            + pages.to(tl.int64)[:, None, None] * page_stride
            + (start % PAGE_SIZE + slots)[None, :, None] * slot_stride
            + dims[None, None, :]
        )
        tile = _load(ptrs, rows_ok[:, :, None], dims_ok[None, None, :], MASK_DIMS)
        return tl.reshape(tile, [BLOCK_N, BLOCK_D])
    else:
        n = start + tl.arange(0, BLOCK_N)
        rows_ok = n < end
        if SKIP_BEFORE:
            rows_ok &= n >= begin
        page = tl.load(table_row + n // PAGE_SIZE, mask=rows_ok, other=0).to(tl.int64)
        ptrs = cache_ptr + page[:, None] * page_stride + (n % PAGE_SIZE)[:, None] * slot_stride
        return _load(ptrs + dims[None, :], rows_ok[:, None], dims_ok[None, :], MASK_DIMS)


@triton.jit
def _dense_rows(ptr, desc, start, end, row_stride, dims, dims_ok, MASK_DIMS: tl.constexpr,
                USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK_N) of one sequence's dense [new tokens, D] head view; rows
    at or past `end` read zeros (past the sequence may be another's rows or a host's
    padding). The descriptor spans the sequence alone, so TMA zero-fills them itself."""
    if USE_TMA:
        return desc.load([start, 0])
    n = start + tl.arange(0, BLOCK_N)
    ptrs = ptr + n.to(tl.int64)[:, None] * row_stride + dims[None, :]
    return _load(ptrs, (n < end)[:, None], dims_ok[None, :], MASK_DIMS)


@triton.jit
def _fold(q, k, v, m_i, l_i, acc, n, last, first, masked, scale, soft_cap,
          USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Folds one key block into the online softmax (log2 domain).

    n: the block's key indices; row r sees keys in (first[r], last[r]] (first only with a
    window). masked: some row does not see the whole block. Without a window every row
    has seen a key by its first block, so the running max is finite and -inf scores need
    no care.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if USE_SOFT_CAP:
        s = soft_cap * (2 * tl.sigmoid(2 * (s * scale) / soft_cap) - 1)  # tanh
        s_scale = LOG2E
    else:
        s_scale = scale * LOG2E
    if masked:
        visible = n[None, :] <= last[:, None]
        if USE_WINDOW:
            visible &= n[None, :] > first[:, None]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    m_exp = m_new
    if USE_WINDOW:  # rows that have seen no key yet: exp2(-inf - -inf) would be NaN
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * s_scale - m_exp[:, None])
    alpha = tl.exp2(m_i - m_exp)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


# seq_offset (the batch's decode count) changes from step to step: specialising on it
# (==1, %16) would recompile the kernel mid-serving.
@triton.jit(do_not_specialize=["seq_offset"])
def _prefill_kernel(
    q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_table_ptr, seq_lens_ptr, query_start_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h, bt_stride,
    scale, soft_cap, window, group, seq_offset, sinks_ptr, v_scale,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_ROWS: tl.constexpr,
    DENSE_KV: tl.constexpr, HAS_PREFIX: tl.constexpr, USE_TMA: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    USE_SINKS: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    seq = tl.program_id(1) + seq_offset
    # The last tiles of a sequence see the most keys: launch them first.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    context = 0
    if HAS_PREFIX or not DENSE_KV:
        context = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // group
    MASK_D: tl.constexpr = BLOCK_D != HEAD_DIM
    MASK_DV: tl.constexpr = BLOCK_DV != V_HEAD_DIM
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    dims_ok = dims < HEAD_DIM
    vdims_ok = vdims < V_HEAD_DIM
    token = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = (q_start + token).to(tl.int64)
    rows_ok = token < q_len
    q = _load(q_ptr + rows[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
              rows_ok[:, None], dims_ok[None, :], MASK_D)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink as a first key of zero value (log2 domain, as the scores)
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    first_token = tile * BLOCK_M
    tile_end = tl.minimum(first_token + BLOCK_M, q_len)  # new tokens the tile can see

    # Keys from the pages, in position space: the cached prefix, or every key without
    # dense K/V. Blocks start at multiples of BLOCK_N, so page aligned. Key blocks below
    # full_end are visible to every row of the tile (none with a window).
    if HAS_PREFIX or not DENSE_KV:
        table_row = block_table_ptr + seq.to(tl.int64) * bt_stride
        k_pages = k_cache_ptr + kv_head * k_stride_h
        v_pages = v_cache_ptr + kv_head * v_stride_h
        paged_end = context
        if not DENSE_KV:
            paged_end = context + tile_end
        last = tl.minimum(context + token, paged_end - 1)
        first = context + token - window
        lo = 0
        begin = 0  # the tile's first visible key
        full_end = tl.minimum(context + first_token, paged_end) // BLOCK_N * BLOCK_N
        if USE_WINDOW:  # the window's lower edge needs the mask everywhere
            begin = tl.maximum(0, context + first_token - window + 1)
            lo = begin // BLOCK_N * BLOCK_N
            full_end = lo
        for start in tl.range(lo, paged_end, BLOCK_N):
            # Pages wholly before `begin` may be freed (placeholders in the table): the
            # block that straddles the window's edge leaves them unread.
            k = _page_rows(k_pages, table_row, start, begin, paged_end, k_stride_b, k_stride_s,
                           dims, dims_ok, MASK_D, PAGE_SIZE, PAGE_ROWS, BLOCK_N, BLOCK_D,
                           USE_WINDOW)  # fmt: skip
            v = _page_rows(v_pages, table_row, start, begin, paged_end, v_stride_b, v_stride_s,
                           vdims, vdims_ok, MASK_DV, PAGE_SIZE, PAGE_ROWS, BLOCK_N, BLOCK_DV,
                           USE_WINDOW)  # fmt: skip
            if FP8:  # widens exactly; k_scale is inside `scale`, v_scale applied at the end
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            m_i, l_i, acc = _fold(q, k, v, m_i, l_i, acc, start + tl.arange(0, BLOCK_N), last,
                                  first, start >= full_end, scale, soft_cap, USE_SOFT_CAP,
                                  USE_WINDOW, PRECISION)  # fmt: skip

    # The sequence's new keys from the dense K/V, in new-token index space.
    if DENSE_KV:
        k_seq = key_ptr + q_start.to(tl.int64) * key_stride_t + kv_head * key_stride_h
        v_seq = value_ptr + q_start.to(tl.int64) * value_stride_t + kv_head * value_stride_h
        if USE_TMA:
            k_desc = tl.make_tensor_descriptor(k_seq, shape=[q_len, HEAD_DIM],
                                               strides=[key_stride_t, 1],
                                               block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
            v_desc = tl.make_tensor_descriptor(v_seq, shape=[q_len, V_HEAD_DIM],
                                               strides=[value_stride_t, 1],
                                               block_shape=[BLOCK_N, V_HEAD_DIM])  # fmt: skip
        else:
            k_desc = k_seq
            v_desc = v_seq
        first = token - window
        lo = 0
        full_end = first_token // BLOCK_N * BLOCK_N
        if USE_WINDOW:
            lo = tl.maximum(0, first_token - window + 1) // BLOCK_N * BLOCK_N
            full_end = lo
        for start in tl.range(lo, tile_end, BLOCK_N):
            k = _dense_rows(k_seq, k_desc, start, q_len, key_stride_t, dims, dims_ok, MASK_D,
                            USE_TMA, BLOCK_N)  # fmt: skip
            v = _dense_rows(v_seq, v_desc, start, q_len, value_stride_t, vdims, vdims_ok, MASK_DV,
                            USE_TMA, BLOCK_N)  # fmt: skip
            m_i, l_i, acc = _fold(q, k, v, m_i, l_i, acc, start + tl.arange(0, BLOCK_N), token,
                                  first, start >= full_end, scale, soft_cap, USE_SOFT_CAP,
                                  USE_WINDOW, PRECISION)  # fmt: skip

    if FP8:
        acc = acc * v_scale
    acc = acc / l_i[:, None]  # every valid row sees at least its own key
    o_ptrs = out_ptr + rows[:, None] * o_stride_t + head * o_stride_h + vdims[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None] & vdims_ok[None, :])


def pick_config(query: torch.Tensor, head_dim: int, max_query_len: int) -> dict:
    block_d = triton.next_power_of_2(head_dim)
    if block_d > 256:
        return HUGE_CONFIG
    if query.element_size() != 2 or block_d > 128:
        return WIDE_CONFIG
    return LONG_CONFIG if max_query_len >= LONG_TOKENS else SHORT_CONFIG


def _page_rows_per_entry(page_size: int, block_n: int) -> int:
    """Rows a block reads per table entry, or 0 where pages and blocks do not nest."""
    if block_n % page_size == 0:
        return page_size
    if page_size % block_n == 0:
        return block_n
    return 0


def _use_tma(config: dict, query, key, value, v_head_dim: int) -> bool:
    """Descriptors read whole power-of-two heads from 16-byte aligned rows; the default
    configs ask for them only in 16-bit (tests force them in fp32 under the interpreter)."""
    head_dim = query.shape[2]
    return (
        config["tma"]
        and (query.element_size() == 2 or query.device.type == "cpu")
        and head_dim == triton.next_power_of_2(head_dim) >= 16
        and v_head_dim == triton.next_power_of_2(v_head_dim) >= 16
        and tma_supported(query.device)
        and tma_ready(key)
        and tma_ready(value)
    )


def prefill_attention(
    query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
    key=None, value=None, sinks=None, config=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The prefill sequences of the batch (those after its decodes) into `out`.

    key/value [T, Hkv, D|Dv]: the step's new tokens' K/V (already written to the cache,
    i.e. rotated), row t for query row t; without them every key is read from the pages.
    An fp8 cache (scales k_scale, v_scale) holds them quantized: they are not used then.
    sinks [Hq]: attention-sink logits, or None.
    config: launch parameters (pick_config's by default).
    """
    num_prefills = metadata.num_seqs - metadata.num_decodes
    head_dim, v_head_dim = query.shape[2], value_cache.shape[3]
    config = config or pick_config(query, head_dim, metadata.max_query_len)
    fp8 = is_fp8_kv_cache(key_cache)
    dense = key is not None and not fp8
    use_tma = dense and _use_tma(config, query, key, value, v_head_dim)
    if use_tma and query.is_cuda:
        use_scratch_allocator()
    block_m, block_n = config["block_m"], config["block_n"]
    grid = (query.shape[1], num_prefills, triton.cdiv(metadata.max_query_len, block_m))
    page_size = key_cache.shape[1]
    dense_args = (
        (key.stride(0), key.stride(1), value.stride(0), value.stride(1)) if dense else (0,) * 4
    )
    _prefill_kernel[grid](
        query, key if dense else query, value if dense else query, key_cache, value_cache, out,
        metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *dense_args,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        metadata.block_table.stride(0),
        scale * k_scale if fp8 else scale, logits_soft_cap or 0.0, sliding_window or 0,
        query.shape[1] // key_cache.shape[2],
        metadata.num_decodes, query if sinks is None else sinks, v_scale,
        HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, PAGE_ROWS=_page_rows_per_entry(page_size, block_n),
        DENSE_KV=dense, HAS_PREFIX=not dense or metadata.prefills_have_context, USE_TMA=use_tma,
        USE_SOFT_CAP=bool(logits_soft_cap), USE_WINDOW=bool(sliding_window),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", USE_SINKS=sinks is not None,
        FP8=fp8, num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out
