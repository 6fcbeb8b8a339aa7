"""Groups the (token, slot) pairs of a top-k routing by expert, in M-blocks of one expert each.

The fused-MoE GEMMs take one block of BLOCK_M rows per program, all of the same expert.
This step lays the T*k routed rows out accordingly: expert e's rows start at a multiple
of BLOCK_M and its last block is padded with the sentinel T*k. It runs entirely on the
GPU (atomics, no host round trip), so its buffers are sized by the worst case: every
non-empty expert wastes at most BLOCK_M - 1 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # routed rows per program in the counting and scattering kernels
_BLOCK_B = 64  # M-blocks labelled per step in the layout kernel
# Up to this many routed rows (decode batches: T * top_k), one program does all three
# steps: the three launches and the counters' fill cost more than the work.
SINGLE_PROGRAM_ROWS = 1024


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_rows, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_rows, other=0)
    mask = (offs < num_rows) & (expert < num_experts)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask, sem="relaxed")


@triton.jit
def _lay_out(
    counts, cursor_ptr, sorted_ptr, block_expert_ptr, num_experts, num_rows, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Expert start offsets (into the scatter cursors), the padding sentinels and the
    expert of every M-block (num_experts for blocks past the end)."""
    expert = tl.arange(0, BLOCK_E)
    is_expert = expert < num_experts
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(cursor_ptr + expert, starts, mask=is_expert)
    pad = tl.arange(0, BLOCK_M)[None, :]
    pad_pos = (starts + counts)[:, None] + pad
    tl.store(sorted_ptr + pad_pos, num_rows, mask=is_expert[:, None] & (pad_pos < ends[:, None]))
    # Block b belongs to the expert whose range contains b * BLOCK_M: the number of
    # experts whose (padded) range ends at or before it.
    ends = tl.where(is_expert, ends, 2**31 - 1)
    for first in range(0, max_blocks, BLOCK_B):
        block = first + tl.arange(0, BLOCK_B)
        owner = tl.sum((ends[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, owner, mask=block < max_blocks)


@triton.jit
def _layout_kernel(
    counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_experts, num_rows, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    expert = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + expert, mask=expert < num_experts, other=0)
    _lay_out(counts, cursor_ptr, sorted_ptr, block_expert_ptr, num_experts, num_rows, max_blocks,
             BLOCK_M, BLOCK_E, BLOCK_B)  # fmt: skip


@triton.jit
def _align_in_one_program_kernel(
    ids_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_experts, num_rows, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Count, lay out and scatter in one launch for a decode-sized routing: the counts come
    from a histogram instead of atomics, so no zeroed buffer (and no fill launch) is needed."""
    offs = tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_rows, other=0)
    mask = (offs < num_rows) & (expert < num_experts)
    counts = tl.histogram(expert, BLOCK_E, mask=mask)
    _lay_out(counts, cursor_ptr, sorted_ptr, block_expert_ptr, num_experts, num_rows, max_blocks,
             BLOCK_M, BLOCK_E, BLOCK_B)  # fmt: skip
    tl.debug_barrier()  # the cursors' starting offsets are stored before the atomics read them
    position = tl.atomic_add(cursor_ptr + expert, 1, mask=mask, sem="relaxed")
    tl.store(sorted_ptr + position, offs, mask=mask)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_rows, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_rows, other=0)
    mask = (offs < num_rows) & (expert < num_experts)
    # The order within an expert is whatever the atomics give: each output row is computed
    # on its own, so the result does not depend on it.
    position = tl.atomic_add(cursor_ptr + expert, 1, mask=mask, sem="relaxed")
    tl.store(sorted_ptr + position, offs, mask=mask)


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    return num_rows + min(num_experts, num_rows) * (block_m - 1)


def align_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_expert): sorted_rows[i] is a flat index t * k + slot into topk_ids
    (or the sentinel T*k), block_expert[b] the expert of rows [b*block_m, (b+1)*block_m)
    (num_experts past the last used block). Ids >= num_experts (experts another
    expert-parallel rank holds) get no row: sum_top_k skips their slots."""
    ids = topk_ids.reshape(-1)
    num_rows = ids.numel()
    max_blocks = triton.cdiv(max_padded_rows(num_rows, num_experts, block_m), block_m)
    device = topk_ids.device
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    layout = dict(BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_B=_BLOCK_B)
    if num_rows <= SINGLE_PROGRAM_ROWS:
        cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
        _align_in_one_program_kernel[(1,)](
            ids, cursor, sorted_rows, block_expert, num_experts, num_rows, max_blocks,
            BLOCK=max(16, triton.next_power_of_2(num_rows)), **layout,
        )  # fmt: skip
        return sorted_rows, block_expert
    counts_and_cursor = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
    counts, cursor = counts_and_cursor
    grid = (triton.cdiv(num_rows, _BLOCK),)
    _count_kernel[grid](ids, counts, num_rows, num_experts, BLOCK=_BLOCK)
    _layout_kernel[(1,)](
        counts, cursor, sorted_rows, block_expert, num_experts, num_rows, max_blocks, **layout
    )
    _scatter_kernel[grid](ids, cursor, sorted_rows, num_rows, num_experts, BLOCK=_BLOCK)
    return sorted_rows, block_expert
