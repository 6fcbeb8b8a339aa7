"""Top-k over the valid prefix of each score row, the prefix's length read on the device.

The indexers (atom.kernels.triton.indexer, .compressed_attention) score each query token
against the keys it sees, a count that differs per token and lives on the device. Under
CUDA graphs the score rows are as wide as the graphs' bound (max_model_len), so a top-k over
whole rows would read and sort mostly padding at every step. Here one program per row reads
only its first `lengths[row]` scores: a radix select finds the k-th largest score's key
(RADIX_BITS at a time, a histogram of the rows still in the running per pass), then one more
pass writes the positions above it and, of the positions equal to it, the earliest, so the
selection is `atom.kernels.indexer.best_positions`'s: equal scores go to the earlier
position. Positions come out in row order, not by score; -1 fills the rest of a row that
has fewer than k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
RADIX_BITS = 8


@triton.jit
def _order_keys(scores):
    """fp32 scores as uint32 keys of the same order (-0.0 taken as 0.0)."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats run backwards
    return ordered.to(tl.uint32, bitcast=True) ^ 0x80000000  # signed order to unsigned


@triton.jit
def _prefix_topk_kernel(
    scores_ptr, lengths_ptr, out_ptr, s_stride, o_stride, width, k,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.load(lengths_ptr + row).to(tl.int32), width)
    scores_row = scores_ptr + row * s_stride
    out_row = out_ptr + row * o_stride
    offsets = tl.arange(0, BLOCK)
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    bins = tl.arange(0, NUM_BINS)

    for start in range(0, k, BLOCK):  # the slots no position will fill
        n = start + offsets
        tl.store(out_row + n, tl.full([BLOCK], -1, tl.int32), mask=(n >= length) & (n < k))

    if length <= k:
        threshold = tl.full([], 0, tl.uint32)  # below every score's key: all are taken
        take_equal = length
    else:
        # The k-th largest key, RADIX_BITS at a time from the top: `prefix` holds the bits
        # fixed so far, `remaining` how many of the keys that share them are still to take.
        prefix = tl.full([], 0, tl.uint32)
        prefix_mask = tl.full([], 0, tl.uint32)
        remaining = k
        for shift in tl.static_range(32 - RADIX_BITS, -1, -RADIX_BITS):
            counts = tl.zeros([NUM_BINS], tl.int32)
            for start in range(0, length, BLOCK):
                n = start + offsets
                valid = n < length
                keys = _order_keys(tl.load(scores_row + n, mask=valid, other=0.0))
                running = valid & ((keys & prefix_mask) == prefix)
                digits = ((keys >> shift) & (NUM_BINS - 1)).to(tl.int32)
                counts += tl.histogram(digits, NUM_BINS, mask=running)
            at_or_above = tl.cumsum(counts, 0, reverse=True)
            digit = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
            remaining -= tl.sum(tl.where(bins > digit, counts, 0), 0)
            prefix = prefix | (digit.to(tl.uint32) << shift)
            prefix_mask = prefix_mask | tl.full([], (NUM_BINS - 1) << shift, tl.uint32)
        threshold = prefix
        take_equal = remaining

    taken = 0
    equal_seen = 0
    for start in range(0, length, BLOCK):
        n = start + offsets
        valid = n < length
        keys = _order_keys(tl.load(scores_row + n, mask=valid, other=0.0))
        equal = (valid & (keys == threshold)).to(tl.int32)
        earliest_equal = (equal_seen + tl.cumsum(equal, 0) - equal) < take_equal
        take = ((valid & (keys > threshold)) | ((equal > 0) & earliest_equal)).to(tl.int32)
        tl.store(out_row + taken + tl.cumsum(take, 0) - take, n, mask=take > 0)
        taken += tl.sum(take, 0)
        equal_seen += tl.sum(equal, 0)


def prefix_topk(
    scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions [T, k] int32 of the k highest of scores[t, :lengths[t]] ([T, width] fp32;
    lengths [T] on the device), equal scores to the earlier position, in position order;
    -1 past a row's min(lengths[t], k). Scores past a row's length are never read. `out`:
    an int32 [T, k] view to write them into (the first k columns of a wider table)."""
    num_rows, width = scores.shape
    if out is None:
        out = torch.empty(num_rows, k, dtype=torch.int32, device=scores.device)
    if num_rows == 0 or k == 0:
        return out
    for name, x in (("scores", scores), ("out", out)):
        if x.stride(1) != 1:
            raise ValueError(
                f"prefix_topk: {name} must be contiguous in a row, strides {x.stride()}"
            )
    _prefix_topk_kernel[(num_rows,)](
        scores, lengths, out, scores.stride(0), out.stride(0), width, k,
        BLOCK=BLOCK, RADIX_BITS=RADIX_BITS, num_warps=8,
    )  # fmt: skip
    return out
