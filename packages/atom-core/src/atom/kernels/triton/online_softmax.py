"""The online-softmax step the attention kernels share: fold one block of keys' scores
and values into a running (max, sum, weighted values) state, in the log2 domain."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fold_block(s, values, m_i, l_i, acc, PRECISION: tl.constexpr):
    """s [M, N]: scores already scaled by log2(e), -inf where masked; values [N, Dv].
    -> the state (m_i [M], l_i [M], acc [M, Dv]) with the block folded in."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may have seen no key yet (masked blocks, ragged selections): keep the
    # exponent's offset finite and let those columns contribute 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc
