"""Causal paged prefill for Hopper and newer: Q tiles and K/V pages arrive by TMA.

The cache [num_blocks, block_size, Hkv, D] is read as the 2-D tensor
[num_blocks * block_size, Hkv * D]; one kv head's keys in one page are then the box
[block_size, D] at row page * block_size, column kv_head * D. A key tile of BLOCK_N
keys is one box when a page holds the whole tile, else BLOCK_N / block_size page boxes
stacked in order. Unlike per-row gathered pointers, descriptor loads let Triton issue
them asynchronously and feed Hopper's wgmma from shared memory.

The math (GQA row packing, exp2 online softmax, causal bound with a cached prefix,
window, soft cap) is the gathered kernel's, shared through its block helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atom.kernels.triton.paged_attention import _block_scores, _fold_block

# To be set from benchmarks/tune_prefill.py on an H100 (bf16, head dim 128, 32 q / 8 kv
# heads, 16-token pages). "tiles_first" launches a (sequence, kv head)'s tiles next to
# each other so they share its K/V in L2; otherwise every sequence's last tile goes
# first. "split_pages": see _attend_split_pages. No warp specialization: Triton 3.6's
# Hopper pass ignores it at 8 warps and fails to compile this kernel at 4.
PREFILL_TMA_CONFIG = {
    "rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3,
    "tiles_first": False, "split_pages": False,
}  # fmt: skip
LONG_PREFILL_TMA_CONFIG = {
    "rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 2,
    "tiles_first": False, "split_pages": False,
}  # fmt: skip
LONG_PREFILL_TOKENS = 4096
WIDE_PREFILL_TMA_CONFIG = {  # 256-wide heads: smaller tiles to fit shared memory
    "rows": 64, "block_n": 64, "num_warps": 4, "num_stages": 2,
    "tiles_first": False, "split_pages": False,
}  # fmt: skip
HEAD_DIMS = (64, 128, 256)
MIN_PAGE_ROWS = 16  # narrower boxes make too many TMA loads (and dots) per tile


@triton.jit
def _load_key_rows(desc, table_row, start, col, kv_end, block_size,
                   ROWS: tl.constexpr, PAGE_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Cache rows of keys [start, start + ROWS) of one kv head: [ROWS, HEAD_DIM].

    Halves recursively down to single page boxes and stacks the halves, so the rows
    come out in key order. Pages past the sequence read page 0; callers mask them.
    """
    if ROWS == PAGE_ROWS:
        page = tl.load(table_row + start // block_size, mask=start < kv_end, other=0)
        return desc.load([page * block_size + start % block_size, col])
    else:
        half: tl.constexpr = ROWS // 2
        low = _load_key_rows(desc, table_row, start, col, kv_end, block_size,
                             half, PAGE_ROWS, HEAD_DIM)  # fmt: skip
        high = _load_key_rows(desc, table_row, start + half, col, kv_end, block_size,
                              half, PAGE_ROWS, HEAD_DIM)  # fmt: skip
        return tl.reshape(tl.permute(tl.join(low, high), (2, 0, 1)), (ROWS, HEAD_DIM))


@triton.jit
def _attend_split_pages(
    q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
    block_size, scale, soft_cap, BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr,
    MASKED: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the tile, but one dot per page box.

    Nothing is restacked in registers, so every box goes from TMA straight into wgmma;
    the price is narrow (PAGE_ROWS-wide) q @ k^T products.
    """
    rows = ()
    scores = ()
    m_new = m_i
    for j in tl.static_range(BLOCK_N // PAGE_ROWS):
        first = start + j * PAGE_ROWS
        page = tl.load(table_row + first // block_size, mask=first < kv_end, other=0)
        row = page * block_size + first % block_size
        n = first + tl.arange(0, PAGE_ROWS)
        s = _block_scores(q, k_desc.load([row, col]), n, kv_end, q_pos, window, scale,
                          soft_cap, MASKED, USE_SOFT_CAP, USE_WINDOW, PRECISION)  # fmt: skip
        m_new = tl.maximum(m_new, tl.max(s, 1))
        rows = rows + (row,)
        scores = scores + (s,)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha
    for j in tl.static_range(BLOCK_N // PAGE_ROWS):
        p = tl.exp2(scores[j] - m_safe[:, None])
        l_i += tl.sum(p, 1)
        v = v_desc.load([rows[j], col])
        if MASKED:
            n = start + j * PAGE_ROWS + tl.arange(0, PAGE_ROWS)
            v = tl.where((n < kv_end)[:, None], v, 0.0)  # see _attend_stacked
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_stacked(
    q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
    block_size, scale, soft_cap, BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the tile, its page boxes stacked into one K and V."""
    n = start + tl.arange(0, BLOCK_N)
    k = _load_key_rows(k_desc, table_row, start, col, kv_end, block_size,
                       BLOCK_N, PAGE_ROWS, HEAD_DIM)  # fmt: skip
    s = _block_scores(q, k, n, kv_end, q_pos, window, scale, soft_cap,
                      MASKED, USE_SOFT_CAP, USE_WINDOW, PRECISION)  # fmt: skip
    v = _load_key_rows(v_desc, table_row, start, col, kv_end, block_size,
                       BLOCK_N, PAGE_ROWS, HEAD_DIM)  # fmt: skip
    if MASKED:
        # Slots past the sequence were never written: NaN garbage would survive p == 0.
        v = tl.where((n < kv_end)[:, None], v, 0.0)
    return _fold_block(s, v, m_i, l_i, acc, PRECISION)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
    block_size, scale, soft_cap, BLOCK_N: tl.constexpr, PAGE_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, SPLIT_PAGES: tl.constexpr,
):  # fmt: skip
    if SPLIT_PAGES:
        return _attend_split_pages(
            q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
            block_size, scale, soft_cap, BLOCK_N, PAGE_ROWS, MASKED, USE_SOFT_CAP,
            USE_WINDOW, PRECISION,
        )  # fmt: skip
    else:
        return _attend_stacked(
            q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
            block_size, scale, soft_cap, BLOCK_N, PAGE_ROWS, HEAD_DIM, MASKED, USE_SOFT_CAP,
            USE_WINDOW, PRECISION,
        )  # fmt: skip


@triton.jit(do_not_specialize=["seq_offset"])  # the decode count varies per step
def _prefill_tma_kernel(
    q_desc, k_desc, v_desc, out_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    o_stride_t, o_stride_h, bt_stride, scale, soft_cap, window, group, block_size, seq_offset,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    TILES_FIRST: tl.constexpr, SPLIT_PAGES: tl.constexpr,
):  # fmt: skip
    # Either way the last tiles of a sequence, which see the most keys, start first.
    if TILES_FIRST:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(2) + seq_offset
    else:
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        seq = tl.program_id(0) + seq_offset
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # Box [BLOCK_M tokens, GROUP heads, D]: row r is token r // GROUP, head r % GROUP.
    # Rows past the sequence or the kv head's group are computed but never stored.
    q = q_desc.load([q_start + tile * BLOCK_M, kv_head * group, 0])
    q = tl.reshape(q, (BLOCK_M * GROUP, HEAD_DIM))
    rows = tl.arange(0, BLOCK_M * GROUP)
    token = tile * BLOCK_M + rows // GROUP
    q_pos = context + token

    first_row_pos = context + tile * BLOCK_M
    kv_end = context + tl.minimum((tile + 1) * BLOCK_M, q_len)
    full_end = first_row_pos // BLOCK_N * BLOCK_N  # keys every row of the tile sees
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(0, first_row_pos - window + 1) // BLOCK_N * BLOCK_N
        full_end = kv_start  # the window's lower edge needs the mask everywhere
    m_i = tl.full([BLOCK_M * GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP, HEAD_DIM], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * bt_stride
    col = kv_head * HEAD_DIM
    for start in range(kv_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
            block_size, scale, soft_cap, BLOCK_N, PAGE_ROWS, HEAD_DIM, False,
            USE_SOFT_CAP, USE_WINDOW, PRECISION, SPLIT_PAGES,
        )  # fmt: skip
    for start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, q_pos, window, k_desc, v_desc, table_row, col,
            block_size, scale, soft_cap, BLOCK_N, PAGE_ROWS, HEAD_DIM, True,
            USE_SOFT_CAP, USE_WINDOW, PRECISION, SPLIT_PAGES,
        )  # fmt: skip
    acc = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    head = kv_head * group + rows % GROUP
    row_valid = (token < q_len) & (rows % GROUP < group)
    dims = tl.arange(0, HEAD_DIM)
    o_ptrs = (
        out_ptr
        + (q_start + token).to(tl.int64)[:, None] * o_stride_t
        + head[:, None] * o_stride_h
        + dims[None, :]
    )
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA wants a 16-byte aligned base and 16-byte multiples for every outer stride."""
    outer = t.stride()[:-1]
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(s * t.element_size() % 16 == 0 for s in outer)
    )


def supports(query, key_cache, value_cache) -> bool:
    """Whether the TMA kernel handles these tensors on this device (else: gathered kernel).

    The flat [num_blocks * block_size, Hkv * D] cache view needs each page's rows on
    one stride and each token's heads packed back to back.
    """
    hopper = query.is_cuda and torch.version.hip is None  # ROCm reports gfx9 as 9.x
    if not hopper or torch.cuda.get_device_capability(query.device)[0] < 9:
        return False
    block_size, head_dim = key_cache.shape[1], key_cache.shape[3]
    return (
        head_dim in HEAD_DIMS
        and value_cache.shape == key_cache.shape
        and query.shape[2] == head_dim
        and query.element_size() == 2
        and query.dtype == key_cache.dtype == value_cache.dtype
        and _is_pow2(block_size)
        and block_size >= MIN_PAGE_ROWS
        and all(
            c.stride(0) == block_size * c.stride(1) and c.stride(2) == head_dim and _tma_ready(c)
            for c in (key_cache, value_cache)
        )
        and _tma_ready(query)
    )


def pick_config(max_query_len: int, head_dim: int) -> dict:
    if head_dim > 128:
        return WIDE_PREFILL_TMA_CONFIG
    if max_query_len >= LONG_PREFILL_TOKENS:
        return LONG_PREFILL_TMA_CONFIG
    return PREFILL_TMA_CONFIG


def prefill_attention_tma(
    query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap, out,
    config=None,
):  # fmt: skip
    """The prefill sequences of the batch (those after its decodes) into `out`."""
    num_prefills = metadata.num_seqs - metadata.num_decodes
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    if config is None:
        config = pick_config(metadata.max_query_len, head_dim)
    group_block = triton.next_power_of_2(group)
    block_m = max(1, config["rows"] // group_block)
    block_n = config["block_n"]
    page_rows = min(block_size, block_n)  # one box per page, or per tile of a big page
    q_desc = TensorDescriptor.from_tensor(query, [block_m, group_block, head_dim])
    flat = [num_blocks * block_size, num_kv_heads * head_dim]
    k_desc, v_desc = (
        TensorDescriptor(c, flat, [c.stride(1), 1], [page_rows, head_dim])
        for c in (key_cache, value_cache)
    )
    num_tiles = triton.cdiv(metadata.max_query_len, block_m)
    grid = (num_prefills, num_kv_heads, num_tiles)
    if config["tiles_first"]:
        grid = grid[::-1]
    _prefill_tma_kernel[grid](
        q_desc, k_desc, v_desc, out, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, out.stride(0), out.stride(1), metadata.block_table.stride(0),
        scale, logits_soft_cap or 0.0, sliding_window or 0, group, block_size,
        metadata.num_decodes,
        BLOCK_M=block_m, GROUP=group_block, BLOCK_N=block_n, PAGE_ROWS=page_rows,
        HEAD_DIM=head_dim, USE_SOFT_CAP=bool(logits_soft_cap), USE_WINDOW=bool(sliding_window),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        TILES_FIRST=config["tiles_first"],
        SPLIT_PAGES=config["split_pages"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out
