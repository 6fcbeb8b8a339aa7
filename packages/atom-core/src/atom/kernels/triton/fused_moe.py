"""Fused MoE: align rows by expert, grouped GEMM w13 with SiLU-and-mul, grouped GEMM w2
with the routing weights, per-token sum. No host synchronisation (CUDA-graph safe).

Both GEMMs run one program per (M-block of one expert, N-tile). The w13 GEMM computes the
gate and up tiles of the same columns side by side (two tiles and dots, or one interleaved
tile and dot: GemmTiles.stacked) and stores silu(gate) * up, so the 2I-wide intermediate
never reaches memory. Weights may be bf16/fp16/fp32, FP8 with a per-expert or per-row
scale (upcast in registers, W8A16), or FP8 with 128x128 block scales, in which case
activations are quantized per token group and the GEMMs run in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from atom.kernels.activation import ClampedSwiGLU
from atom.kernels.fp8 import FP8_DTYPE, quantize_fp8_per_token_group
from atom.kernels.moe import check_moe_activation
from atom.kernels.policy import capturable, register
from atom.kernels.triton.moe_align import align_to_experts
from atom.kernels.triton.tiles import grouped_tile, num_sms

# Weight scale kinds (constexpr SCALES).
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2
# How a GEMM reads gate and up weights (constexpr GATING; see _moe_gemm_kernel).
UNGATED, GATED_PAIR, GATED_STACKED = 0, 1, 2


@dataclass(frozen=True)
class GemmTiles:
    """The launch shape of one grouped GEMM (its M tile is MoEConfig.block_m)."""

    block_n: int
    block_k: int
    group_m: int = 1  # M-blocks swept per N-tile before moving on (L2 reuse of weights)
    num_warps: int = 4
    num_stages: int = 3
    # Gated GEMM only (the down GEMM ignores it): gate and up columns in one 2 * block_n
    # wide tile and one dot (GATED_STACKED) rather than two tiles and two dots.
    stacked: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two GEMMs. They share block_m because both walk the row blocks that
    align_to_experts lays out; the rest differs because the gated w13 GEMM accumulates gate
    and up (twice the registers), so an N-tile the w2 GEMM fills well can spill there."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    @classmethod
    def same(cls, block_m: int, *tiles, **kwargs) -> MoEConfig:
        """Both GEMMs with GemmTiles(*tiles, **kwargs)."""
        both = GemmTiles(*tiles, **kwargs)
        return cls(block_m, both, both)


@triton.jit
def _dot_step(acc, a, b_ptrs, b_mask, scale, SCALES: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if SCALES == 2:  # FP8 x FP8; the block scales vary along K, so apply them per step
        return acc + tl.dot(a, b) * scale
    if SCALES == 1:  # fp8 -> activation dtype is exact; the row scale is applied at the end
        b = b.to(a.dtype)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _scale_ptrs(scale_base, b_rows, stride_bsn, SCALES: tl.constexpr, GROUP_N: tl.constexpr):
    """Per B row (output column): its block scale row (SCALES == 2) or its row scale."""
    if SCALES == 2:
        return scale_base + (b_rows // GROUP_N) * stride_bsn
    return scale_base + b_rows * stride_bsn


@triton.jit
def program_block(block_expert_ptr, max_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M-block, N-tile, expert) of this program. GROUP_M M-blocks sweep each N-tile before
    the next one starts, so their weight tiles are still in L2."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    return pid_m, pid_n, tl.load(block_expert_ptr + pid_m)


@triton.jit
def store_rows(
    acc, acc_up, c_ptr, stride_cm, rows, row_ok, cols, N, expert_bias_ptr, up_offset,
    routing_weights_ptr, swiglu_alpha, swiglu_limit, swiglu_up_shift,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
    APPLY_WEIGHT: tl.constexpr,
):  # fmt: skip
    """The epilogue of both GEMMs: C[rows, cols] = weight[row] * act(acc + bias), where a
    gated GEMM's act combines gate (acc) and up (acc_up, bias entries up_offset further)."""
    if HAS_BIAS:
        col_ok = cols < N
        acc += tl.load(expert_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up_bias = tl.load(expert_bias_ptr + up_offset + cols, mask=col_ok, other=0.0)
            acc_up += up_bias.to(tl.float32)[None, :]
    if GATED:
        if CLAMPED_SWIGLU:
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = (up + swiglu_up_shift) * gate * tl.sigmoid(swiglu_alpha * gate)
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if APPLY_WEIGHT:
        acc *= tl.load(routing_weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, routing_weights_ptr,
    sorted_rows_ptr, block_expert_ptr,
    num_rows, num_experts, N, K, max_blocks, up_offset, swiglu_alpha, swiglu_limit, swiglu_up_shift,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
    stride_bias_e, stride_cm,
    A_ROW_DIV: tl.constexpr, GATING: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
    SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """C[row, :N] = A[row // A_ROW_DIV] @ B[expert]^T for the rows of one M-block.

    B rows are output columns (K contiguous). GATING (UNGATED, GATED_PAIR, GATED_STACKED):
    rows n and n + up_offset of B are the gate and up halves of column n, and C gets
    silu(gate) * up, or with CLAMPED_SWIGLU GPT-OSS's (up + 1) * gate * sigmoid(alpha *
    gate) of the clamped halves. GATED_PAIR loads the gate and up tiles apart, one dot each;
    GATED_STACKED interleaves them (tile column 2j: column j's gate row, 2j + 1: its up row)
    into one 2 * BLOCK_N wide tile and one dot, split apart after the K loop.
    HAS_BIAS adds bias[expert, b_row] before the activation and the routing weight.
    APPLY_WEIGHT scales row r by routing_weights[r]."""
    pid_m, pid_n, expert = program_block(block_expert_ptr, max_blocks, N, BLOCK_N, GROUP_M)
    if expert >= num_experts:  # past the last used block
        return
    expert = expert.to(tl.int64)
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATING == 2:
        pair = tl.arange(0, 2 * BLOCK_N)
        b_cols = pid_n * BLOCK_N + pair // 2  # the output column of each tile column
        b_rows = b_cols + (pair % 2) * up_offset
    else:
        b_cols = cols
        b_rows = cols
    b_ok = b_cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + b_rows.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    up_ptrs = b_ptrs + up_offset * stride_bn  # GATED_PAIR only (unused values are dropped)
    scale_base = b_scale_ptr + expert * stride_bse
    b_scale_ptrs = _scale_ptrs(scale_base, b_rows, stride_bsn, SCALES, GROUP_N)
    up_scale_ptrs = _scale_ptrs(scale_base, b_rows + up_offset, stride_bsn, SCALES, GROUP_N)
    acc = tl.zeros((BLOCK_M, b_rows.shape[0]), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & b_ok[None, :]
        if SCALES == 2:  # BLOCK_K divides GROUP_K: one activation and weight scale per step
            group = k0 // GROUP_K
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + group, mask=row_ok, other=0.0)
            b_scale = tl.load(b_scale_ptrs + group * stride_bsk, mask=b_ok, other=0.0)
            scale = a_scale[:, None] * b_scale[None, :]
            if GATING == 1:
                up_scale = tl.load(up_scale_ptrs + group * stride_bsk, mask=b_ok, other=0.0)
                up_scale = a_scale[:, None] * up_scale[None, :]
        else:
            scale = 1.0
            up_scale = 1.0
        acc = _dot_step(acc, a, b_ptrs, b_mask, scale, SCALES, PRECISION)
        if GATING == 1:
            acc_up = _dot_step(acc_up, a, up_ptrs, b_mask, up_scale, SCALES, PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if SCALES == 1:
        acc *= tl.load(b_scale_ptrs, mask=b_ok, other=0.0)[None, :]
        if GATING == 1:
            acc_up *= tl.load(up_scale_ptrs, mask=b_ok, other=0.0)[None, :]
    if GATING == 2:  # MMA accumulators hold adjacent column pairs per thread
        acc, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    store_rows(
        acc, acc_up, c_ptr, stride_cm, rows, row_ok, cols, N, bias_ptr + expert * stride_bias_e,
        up_offset, routing_weights_ptr, swiglu_alpha, swiglu_limit, swiglu_up_shift,
        GATED=GATING != 0, HAS_BIAS=HAS_BIAS, CLAMPED_SWIGLU=CLAMPED_SWIGLU,
        APPLY_WEIGHT=APPLY_WEIGHT,
    )  # fmt: skip


def pick_config(
    num_rows: int, num_experts: int, inter: int, dtype: torch.dtype, fp8_block: bool, device
) -> MoEConfig:
    """Tiles by the expected rows per expert (uniform routing)."""
    fp32 = dtype == torch.float32  # 4-byte operands: smaller tiles fit shared memory
    block_k = 128 if fp8_block else (32 if fp32 else 64)
    stages = 2 if fp32 else 3
    rows_per_expert = num_rows / num_experts
    if rows_per_expert <= 16:
        # Streaming the weights dominates: one small M-block per expert, long K steps, and
        # narrow N-tiles where wide ones would leave SMs idle. FP8 halves the bytes per
        # stage, and three stages beat four there (docs/performance.md, "Fused MoE tiles").
        used_blocks = min(num_rows, num_experts)
        wide = used_blocks * triton.cdiv(inter, 64) >= 2 * num_sms(device)
        deep = 3 if fp32 or fp8_block else 4
        return MoEConfig.same(16, 64 if wide else 32, block_k if fp32 else 128, 1, 4, deep)
    if rows_per_expert <= 64:
        return MoEConfig.same(32, 64, block_k, 4, 4, stages)
    if fp8_block:
        # From the H100 sweep (benchmarks/moe.py --sweep; docs/performance.md, "Fused MoE
        # tiles"): the down GEMM wants 128-wide tiles and eight warps; past 256 rows per
        # expert both GEMMs take 128-row tiles. The stacked gate/up tile lost here.
        gate_up = GemmTiles(block_n=64, block_k=block_k, group_m=8, num_stages=3)
        down = GemmTiles(block_n=128, block_k=block_k, num_warps=8, num_stages=3)
        if rows_per_expert <= 256:
            return MoEConfig(64, gate_up, down)
        return MoEConfig(128, replace(gate_up, num_warps=8), replace(down, group_m=8))
    if fp32:
        if rows_per_expert <= 256:
            return MoEConfig.same(64, 64, block_k, 8, 4, stages)
        return MoEConfig.same(128, 64, block_k, 8, 8, stages)
    # bf16: the stacked gate/up tile, one 128x256 dot per K step instead of two 128x128,
    # beat the paired form with otherwise equal tiles; the configs below are each the H100
    # sweep's best at its T, group_m included (docs/performance.md, "Fused MoE tiles").
    tiles = GemmTiles(block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)
    if rows_per_expert <= 256:
        return MoEConfig(128, replace(tiles, group_m=1, stacked=True), tiles)
    # The ungated down GEMM fills 256-wide tiles once experts have many rows.
    return MoEConfig(128, replace(tiles, stacked=True), replace(tiles, block_n=256, group_m=1))


def _row_scale(scale: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, int, int]:
    """A per-expert [E] / [E, 1] or per-row [E, N, 1] scale as [E, N or 1] with strides."""
    rows = scale.reshape(num_experts, -1).float()
    return rows, rows.stride(0), (rows.stride(1) if rows.shape[1] > 1 else 0)


@triton.jit
def _sum_top_k_kernel(
    rows_ptr, ids_ptr, out_ptr, hidden, num_experts, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        # A slot routed to another expert-parallel rank's expert has no row written.
        expert = tl.load(ids_ptr + token * TOP_K + slot + tl.zeros_like(cols))
        here = mask & (expert < num_experts)
        acc += tl.load(rows_ptr + (token * TOP_K + slot) * hidden + cols, mask=here, other=0.0).to(
            tl.float32
        )
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_top_k(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k, H] -> [T, H] in fp32, over the slots routed to this rank's experts (ids below
    num_experts): torch's reduction over the middle dim took a quarter of the expert GEMMs'
    time at decode sizes (docs/performance.md, "Fused MoE tiles")."""
    num_tokens, top_k, hidden = rows.shape
    out = rows.new_empty(num_tokens, hidden)
    block = min(1024, triton.next_power_of_2(hidden))
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _sum_top_k_kernel[(num_tokens, triton.cdiv(hidden, block))](
        rows, ids, out, hidden, num_experts, TOP_K=top_k, BLOCK=block
    )
    return out


def _launch_gemm(
    a, a_scale, w, w_scale, out, aligned, block_m, tiles: GemmTiles, block_size, *,
    gated, a_row_div, routing_weights=None, bias=None, activation="silu",
):  # fmt: skip
    sorted_rows, block_expert = aligned
    w = w if w.stride(-1) == 1 else w.contiguous()
    num_experts, n_total, k = w.shape
    n = n_total // 2 if gated else n_total
    gating = (GATED_STACKED if tiles.stacked else GATED_PAIR) if gated else UNGATED
    if w_scale is None:
        scales, w_scale, s_strides = NO_SCALE, w, (0, 0, 0)
    elif block_size is None:
        w_scale, se, sn = _row_scale(w_scale, num_experts)
        scales, s_strides = ROW_SCALE, (se, sn, 0)
    else:
        scales, s_strides = BLOCK_SCALE, w_scale.stride()
    group_n, group_k = block_size if block_size is not None else (1, 1)
    max_blocks = block_expert.numel()
    grid = (max_blocks * triton.cdiv(n, tiles.block_n),)
    clamped = isinstance(activation, ClampedSwiGLU)
    _moe_gemm_kernel[grid](
        a, a if a_scale is None else a_scale, w, w_scale, out if bias is None else bias, out,
        out if routing_weights is None else routing_weights, sorted_rows, block_expert,
        out.shape[0], num_experts, n, k, max_blocks, n if gated else 0,
        activation.alpha if clamped else 0.0, activation.limit if clamped else 0.0,
        activation.up_shift if clamped else 0.0,
        a.stride(0), 0 if a_scale is None else a_scale.stride(0), w.stride(0), w.stride(1),
        *s_strides, 0 if bias is None else bias.stride(0), out.stride(0),
        A_ROW_DIV=a_row_div, GATING=gating, APPLY_WEIGHT=routing_weights is not None,
        HAS_BIAS=bias is not None, CLAMPED_SWIGLU=clamped,
        SCALES=scales, GROUP_N=group_n, GROUP_K=group_k,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _activations(x: torch.Tensor, block_size):
    if block_size is None:
        return x, None
    return quantize_fp8_per_token_group(x, block_size[1])


@register("fused_moe", "triton")
@capturable
def fused_moe_triton(
    hidden, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_size,
    w13_bias=None, w2_bias=None, config: MoEConfig | None = None,
):  # fmt: skip
    check_moe_activation(activation)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.empty(num_tokens, top_k, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out.sum(1)
    if w13.dtype == FP8_DTYPE and w13_scale is None:
        raise ValueError("FP8 experts need their weight scales")
    fp8_block = block_size is not None
    cfg = config or pick_config(
        num_tokens * top_k, num_experts, inter, hidden.dtype, fp8_block, hidden.device
    )
    if fp8_block and any(block_size[1] % t.block_k for t in (cfg.gate_up, cfg.down)):
        # The K loop applies one scale per step.
        raise ValueError(f"FP8 block MoE: the K tiles of {cfg} must divide {block_size[1]}")
    aligned = align_to_experts(topk_ids, num_experts, cfg.block_m)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    a, a_scale = _activations(hidden, block_size)
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(
        a, a_scale, w13, w13_scale, act, aligned, cfg.block_m, cfg.gate_up, block_size,
        gated=True, a_row_div=top_k, bias=w13_bias, activation=activation,
    )  # fmt: skip
    a, a_scale = _activations(act, block_size)
    _launch_gemm(
        a, a_scale, w2, w2_scale, out.view(-1, w2.shape[1]), aligned, cfg.block_m, cfg.down,
        block_size, gated=False, a_row_div=1, routing_weights=topk_weights.reshape(-1),
        bias=w2_bias,
    )  # fmt: skip
    return sum_top_k(out, topk_ids, num_experts)
