"""Fused MoE over MXFP4 experts (atom.kernels.moe_mxfp4), weight-only: the expert weights
stay packed in memory (4.25 bits a value) and each tile is dequantized in registers to the
activation dtype just before its tl.dot.

The pipeline is fused_moe's: align the routed rows by expert (moe_align), a grouped gated
GEMM for w13 that stores act(gate) * up, a grouped GEMM for w2 that applies the routing
weights, and the per-token sum; the block order and the epilogue (bias, clamped SwiGLU,
routing weight) are fused_moe's own helpers. The gated GEMM always stacks each output
column's gate and up rows in one tile (fused_moe's GATED_STACKED), so one dot per K step
serves both halves. No host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.moe import check_moe_activation
from atom.kernels.moe_mxfp4 import MXFP4_GROUP, check_mxfp4_experts
from atom.kernels.policy import capturable, register
from atom.kernels.triton.fused_moe import (
    GemmTiles,
    MoEConfig,
    program_block,
    store_rows,
    sum_top_k,
)
from atom.kernels.triton.moe_align import align_to_experts
from atom.kernels.triton.tiles import num_sms


@triton.jit
def _e2m1_to_bf16(codes):
    """4-bit codes (int32, 0-15) -> their values, exactly.

    The bf16 bits are built directly: codes 2-7 (magnitude 1 to 6) are normal numbers whose
    exponent is code >> 1 and mantissa bit code & 1, so shifting the 3-bit code to bit 6 and
    adding the exponent bias (126, one below bf16's, e2m1 being biased by 1) gives them;
    code 1 (0.5) is e2m1's one subnormal and code 0 is zero, both fixed up by the select."""
    magnitude = codes & 7
    bits = tl.where(magnitude >= 2, (magnitude << 6) + (126 << 7), magnitude * (126 << 7))
    bits = bits | ((codes & 8) << 12)  # the sign
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mxfp4_halves(byte_ptrs, scale_ptrs, mask, DTYPE: tl.constexpr):
    """The weights a [BLOCK_K / 2, rows] tile of packed bytes holds, transposed for the dot:
    (the low nibbles: even k, the high nibbles: odd k), each [BLOCK_K / 2, rows] in DTYPE,
    times the group's scale (masked entries are zero). Exact: a value times a power of two
    (the multiply runs in DTYPE, as Triton's interpreter has no bf16 math)."""
    packed = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    exponent = tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32)
    # 2^(e - 127) is bf16's exponent field e; e = 0 (2^-127) is a bf16 subnormal.
    scale = tl.where(exponent == 0, 1 << 6, exponent << 7)
    scale = scale.to(tl.uint16).to(tl.bfloat16, bitcast=True).to(DTYPE)
    low = _e2m1_to_bf16(packed & 0x0F).to(DTYPE) * scale
    high = _e2m1_to_bf16(packed >> 4).to(DTYPE) * scale
    return low, high


@triton.jit
def _mxfp4_moe_gemm_kernel(
    a_ptr, blocks_ptr, scales_ptr, bias_ptr, c_ptr, routing_weights_ptr,
    sorted_rows_ptr, block_expert_ptr,
    num_rows, num_experts, N, K, max_blocks, up_offset, swiglu_alpha, swiglu_limit, swiglu_up_shift,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_bias_e, stride_cm,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """C[row, :N] = A[row // A_ROW_DIV] @ W[expert]^T for the rows of one M-block, W in
    MXFP4 (blocks [E, N', K/32, 16], scales [E, N', K/32]). GATED: W rows n and
    n + up_offset are column n's gate and up; they fill tile columns 2j and 2j + 1 of one
    2 * BLOCK_N wide tile and are split apart after the K loop."""
    pid_m, pid_n, expert = program_block(block_expert_ptr, max_blocks, N, BLOCK_N, GROUP_M)
    if expert >= num_experts:  # past the last used block
        return
    expert = expert.to(tl.int64)
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATED:
        pair = tl.arange(0, 2 * BLOCK_N)
        w_cols = pid_n * BLOCK_N + pair // 2
        w_rows = w_cols + (pair % 2) * up_offset
    else:
        w_cols = cols
        w_rows = cols
    w_ok = w_cols < N
    w_rows = w_rows.to(tl.int64)
    # The weight tile is read already transposed, [BLOCK_K / 2 bytes, rows], and its two
    # nibbles meet the even and the odd columns of A in two dots: no interleave, reshape or
    # transpose of a register tile (Triton 3.6's dot-operand pass fails on those at
    # BLOCK_M >= 64).
    HALF_K: tl.constexpr = BLOCK_K // 2
    kb = tl.arange(0, HALF_K)  # byte b of a K tile holds k = 2b and 2b + 1
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + 2 * kb[None, :]
    byte_ptrs = blocks_ptr + expert * stride_be + w_rows[None, :] * stride_bn + kb[:, None]
    scale_ptrs = scales_ptr + expert * stride_se + w_rows[None, :] * stride_sn + (kb // 16)[:, None]
    acc = tl.zeros((BLOCK_M, w_rows.shape[0]), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = 2 * kb < K - k0  # K is whole groups of 32, so odd k share the even's mask
        a_mask = row_ok[:, None] & k_ok[None, :]
        a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
        w_even, w_odd = _mxfp4_halves(
            byte_ptrs, scale_ptrs, k_ok[:, None] & w_ok[None, :], a_ptr.dtype.element_ty
        )
        acc = tl.dot(a_even, w_even, acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, w_odd, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        byte_ptrs += HALF_K
        scale_ptrs += BLOCK_K // 32
    if GATED:  # MMA accumulators hold adjacent column pairs per thread
        acc, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        acc_up = acc
    store_rows(
        acc, acc_up, c_ptr, stride_cm, rows, row_ok, cols, N, bias_ptr + expert * stride_bias_e,
        up_offset, routing_weights_ptr, swiglu_alpha, swiglu_limit, swiglu_up_shift,
        GATED=GATED, HAS_BIAS=HAS_BIAS, CLAMPED_SWIGLU=CLAMPED_SWIGLU, APPLY_WEIGHT=APPLY_WEIGHT,
    )  # fmt: skip


def pick_mxfp4_config(
    num_rows: int, num_experts: int, inter: int, dtype: torch.dtype, device
) -> MoEConfig:
    """Tiles by the expected rows per expert (uniform routing). K tiles are whole MXFP4
    groups. Not yet tuned on a GPU: these follow fused_moe's bf16 choices, with K tiles
    twice as long at decode sizes since a packed weight tile is a quarter of the bytes."""
    fp32 = dtype == torch.float32  # 4-byte activations (the interpreter): smaller tiles
    block_k = 64 if fp32 else 128
    rows_per_expert = num_rows / num_experts
    if rows_per_expert <= 16:  # streaming the weights dominates
        used_blocks = min(num_rows, num_experts)
        wide = used_blocks * triton.cdiv(inter, 64) >= 2 * num_sms(device)
        return MoEConfig.same(16, 64 if wide else 32, block_k, 1, 4, 3 if fp32 else 4)
    if rows_per_expert <= 64:
        return MoEConfig.same(32, 64, block_k, 4, 4, 3)
    if fp32:
        return MoEConfig.same(64, 64, 32, 8, 4, 2)
    block_m = 64 if rows_per_expert <= 256 else 128
    return MoEConfig(
        block_m,
        GemmTiles(block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
        GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    )


def _launch_gemm(
    a, blocks, scales, out, aligned, block_m, tiles: GemmTiles, *, gated, a_row_div,
    routing_weights=None, bias=None, activation="silu",
):  # fmt: skip
    if tiles.block_k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 MoE: K tile {tiles.block_k} is not whole groups of 32")
    sorted_rows, block_expert = aligned
    blocks, scales = blocks.contiguous(), scales.contiguous()
    num_experts, n_total, k = blocks.shape[0], blocks.shape[1], blocks.shape[2] * MXFP4_GROUP
    n = n_total // 2 if gated else n_total
    max_blocks = block_expert.numel()
    clamped = isinstance(activation, ClampedSwiGLU)
    _mxfp4_moe_gemm_kernel[(max_blocks * triton.cdiv(n, tiles.block_n),)](
        a, blocks, scales, out if bias is None else bias, out,
        out if routing_weights is None else routing_weights, sorted_rows, block_expert,
        out.shape[0], num_experts, n, k, max_blocks, n if gated else 0,
        activation.alpha if clamped else 0.0, activation.limit if clamped else 0.0,
        activation.up_shift if clamped else 0.0,
        a.stride(0), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        0 if bias is None else bias.stride(0), out.stride(0),
        A_ROW_DIV=a_row_div, GATED=gated, APPLY_WEIGHT=routing_weights is not None,
        HAS_BIAS=bias is not None, CLAMPED_SWIGLU=clamped,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


@register("fused_moe_mxfp4", "triton")
@capturable
def fused_moe_mxfp4_triton(
    hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids, activation,
    w13_bias=None, w2_bias=None, config: MoEConfig | None = None,
):  # fmt: skip
    check_moe_activation(activation)
    check_mxfp4_experts(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, size = w13_blocks.shape[0], w13_blocks.shape[1] // 2, hidden.shape[1]
    out = torch.empty(num_tokens, top_k, size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out.sum(1)
    cfg = config or pick_mxfp4_config(
        num_tokens * top_k, num_experts, inter, hidden.dtype, hidden.device
    )
    aligned = align_to_experts(topk_ids, num_experts, cfg.block_m)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(
        hidden, w13_blocks, w13_scales, act, aligned, cfg.block_m, cfg.gate_up,
        gated=True, a_row_div=top_k, bias=w13_bias, activation=activation,
    )  # fmt: skip
    _launch_gemm(
        act, w2_blocks, w2_scales, out.view(-1, size), aligned, cfg.block_m, cfg.down,
        gated=False, a_row_div=1, routing_weights=topk_weights.reshape(-1), bias=w2_bias,
    )  # fmt: skip
    return sum_top_k(out, topk_ids, num_experts)
