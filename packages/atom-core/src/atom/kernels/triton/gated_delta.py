"""The gated delta rule of Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) on GPUs.

Per sequence and value head, with S a [Dk, Dv] fp32 state, every token t does
    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t delta^T;  o_t = (scale q_t)^T S
(q and k optionally L2-normalised first, as HF's `use_qk_l2norm_in_kernel`).

Decode (one token per sequence) runs that loop directly: one program per (sequence, value
head, Dv tile) keeps its slice of S in registers. Prefill runs it a chunk of C tokens at a
time (the WY / UT-transform form). Within a chunk, with G_i = exp(cumsum of g up to i) and
A the strictly lower [C, C] matrix A_ij = beta_i (k_i . k_j) G_i / G_j, the chunk's deltas are
    delta = U - W S0,   U = (I + A)^-1 diag(beta) V,   W = (I + A)^-1 diag(beta G) K
for the state S0 it starts from; then
    S_C = G_C S0 + sum_j (G_C / G_j) k_j delta_j^T
    o_i = G_i (scale q_i)^T S0 + sum_{j <= i} (scale q_i . k_j) (G_i / G_j) delta_j.
Three kernels, so that only the state recursion is sequential:
- prepare (atom.kernels.triton.gated_delta_prepare): U, W and the in-chunk log decay of
  every chunk at once (or, ChunkLaunch(prepare="staged"), two lighter kernels doing the
  same: atom.kernels.triton.gated_delta_prepare_staged);
- state: one program per (sequence, value head, Dv tile) walks the sequence's chunks in
  order, carrying S in fp32 registers; it stores each chunk's deltas and starting state;
- output: one program per (chunk, value head, Dv tile), all at once, o from those two.
So the output GEMMs, twice the recursion's FLOPs, are off its critical path. W, U, the
deltas and the chunk states go through scratch in the input dtype (bf16 for the models):
half the traffic of fp32, while the state kernel still adds S up in fp32 (see ChunkLaunch).
The state is a pool of per-sequence slots, so the same call serves continuous batching;
the pool may store S in bf16 or fp16 (a host's choice: half the bytes a decode step
moves), which the kernels load into and add up in fp32 all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from atom.kernels.gated_delta import GATED_DELTA_RULE_OP, STATE_DTYPES
from atom.kernels.policy import capturable_up_to, register
from atom.kernels.triton.causal_conv1d import check_varlen_batch
from atom.kernels.triton.gated_delta_prepare import (
    MAX_CHUNK,
    chunk_prepare_kernel,
    chunk_program,
    l2_normalize,
    load_rows,
    store_rows,
)
from atom.kernels.triton.gated_delta_prepare_staged import (
    APPLY_TILE,
    chunk_apply_kernel,
    chunk_inverse_kernel,
    load_tile,
    mma_operand,
)
from atom.kernels.triton.tiles import num_sms

DEFAULT_CHUNK = 64
PREPARE_VARIANTS = ("fused", "staged")
DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of the recurrent (decode) kernel; benchmarks/gated_delta.py
    --sweep --cases decode-B64 decode-B256 times alternatives by replacing DECODE_LAUNCH.
    Several Dv tiles per head spread a small batch over the SMs; a large batch fills them
    with whole heads, whose tiles load the keys and queries once instead of once a tile.
    The Dv tile is the narrowest (block_v) that keeps the grid near target_programs: on
    the H100 32 won at 64 sequences (32 value heads; 8,192 programs), 128 at 256
    (8,192 programs; 1.38x faster than 32: docs/performance.md, "Gated delta decode
    launch")."""

    block_v: int = 32
    num_warps: int = 4
    target_programs: int = 8192

    def tile_v(self, num_seqs: int, num_v_heads: int, full_v: int) -> int:
        spread = triton.cdiv(num_seqs * num_v_heads * full_v, self.target_programs)
        return min(full_v, max(self.block_v, triton.next_power_of_2(spread)))

    def __post_init__(self):
        if self.block_v < 1 or self.block_v & (self.block_v - 1):
            raise ValueError(f"DecodeLaunch: block_v={self.block_v} must be a power of two")


DECODE_LAUNCH = DecodeLaunch()


@dataclass(frozen=True)
class ChunkLaunch:
    """Launch parameters of the chunked-prefill kernels; benchmarks/gated_delta.py --sweep
    times alternatives by replacing CHUNK_LAUNCH.

    Each kernel holds several [C, Dk] fp32 tiles, so warps are set by register spills
    (Triton 3.9 for sm_90a, bf16, Dk = Dv = 128, C = 64, compiled offline; stack bytes a
    thread): prepare 1272 with 8 warps, 1520 with 4; output (Dv tile 64) 144 with 8, 720
    with 4. The state kernel is the sequential part: narrow Dv tiles give one long
    sequence more programs (32 value heads x 128 / 32 = 128 on an H100's 132 SMs). It
    takes a chunk's rows state_rows at a time; with Dv tiles of 32 it spilled 40 bytes at
    16 rows and 8 warps, 552 at 32, 288 at 64; 496, 1232 and 1024 with 4 warps; at 64
    rows, 784 with 16 warps (capped at 128 registers). Only its chunk loop has stages to
    pipeline.

    The low_precision_* flags keep scratch in the input dtype (bf16 for the models) instead
    of fp32, halving its traffic: W and U feed the state recursion (bf16: 4e-3 relative
    state error at Dk = Dv = 128 under the interpreter, the same after 256 and 4096
    tokens); the deltas and chunk states feed only the outputs.

    prepare="staged" (the default) runs the chunk-local part as two light kernels instead of
    the fused one (atom.kernels.triton.gated_delta_prepare_staged: an fp32 inverse per chunk, then
    W and U as tensor-core products of raw inputs in the input dtype); apply_warps are
    its second kernel's. low_precision_dots feeds the output kernel's products and the
    state kernel's W S input-dtype operands (bf16 tensor cores, fp32 accumulate) instead
    of fp32 ones (tf32), as FLA's kernels do: half the registers a [Dk, Dv] tile takes,
    twice the tensor-core rate. The state update k^T delta keeps fp32 operands (bf16 ones
    doubled the state error in the CPU tests, to 1.1e-2 against a 1e-2 tolerance). Under
    Triton's interpreter the operands are rounded to the input dtype and multiplied in
    fp32. The staged prepare with input-dtype dots won the H100 sweep at every prefill
    shape (docs/performance.md, "Gated delta chunk launches")."""

    prepare: str = "staged"
    prepare_warps: int = 4
    apply_warps: int = 4
    state_block_v: int = 32
    state_warps: int = 8
    state_stages: int = 3
    state_rows: int = 64
    output_block_v: int = 128
    output_warps: int = 4
    low_precision_wu: bool = True
    low_precision_deltas: bool = True
    low_precision_dots: bool = True

    def __post_init__(self):
        if self.prepare not in PREPARE_VARIANTS:
            raise ValueError(f"ChunkLaunch: prepare={self.prepare!r} must be one of "
                             f"{PREPARE_VARIANTS}")  # fmt: skip
        for name in ("state_block_v", "state_rows", "output_block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):  # tl.dot tiles: powers of two, >= 16
                raise ValueError(f"ChunkLaunch: {name}={value} must be a power of two >= 16")


# The defaults above won benchmarks/gated_delta.py --sweep for one long sequence; with
# several, a 64-wide state tile with 4 warps won on top, because 64-wide tiles then still
# give every SM a program (8 x 32 heads x 2 tiles at 8 sequences). Figures:
# docs/performance.md, "Gated delta chunk launches".
NARROW_STATE_LAUNCH = ChunkLaunch()
WIDE_STATE_LAUNCH = replace(NARROW_STATE_LAUNCH, state_block_v=64, state_warps=4)
# benchmarks/gated_delta.py --sweep sets this to time one launch for every batch.
CHUNK_LAUNCH: ChunkLaunch | None = None


def chunk_launch(num_seqs: int, num_v_heads: int, dv: int, device: torch.device) -> ChunkLaunch:
    """CHUNK_LAUNCH if set; else the wide state tile when it still fills the SMs."""
    if CHUNK_LAUNCH is not None:
        return CHUNK_LAUNCH
    wide_programs = num_seqs * num_v_heads * triton.cdiv(dv, WIDE_STATE_LAUNCH.state_block_v)
    return WIDE_STATE_LAUNCH if wide_programs >= num_sms(device) else NARROW_STATE_LAUNCH


@triton.jit
def _load_state(state_ptr, slot, head, has_initial, kcols, vcols, dk, dv,
                s_stride_s, s_stride_h, s_stride_k, s_stride_v,
                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """The slot's [Dk, Dv tile] state (zeros when the sequence starts fresh) and its pointers."""
    ptrs = (
        state_ptr
        + slot * s_stride_s
        + head * s_stride_h
        + kcols[:, None] * s_stride_k
        + vcols[None, :] * s_stride_v
    )
    mask = (kcols[:, None] < dk) & (vcols[None, :] < dv)
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if has_initial:
        state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return state, ptrs, mask


@triton.jit
def _chunk_state_ptrs(ptr, chunk, head, num_v_heads, kcols, vcols, dk, dv):
    """A [Dk, Dv tile] slice of the chunk-start states [chunks, Hv, Dk, Dv]."""
    base = ptr + (chunk.to(tl.int64) * num_v_heads + head) * dk * dv
    return base + kcols[:, None] * dv + vcols[None, :]


@triton.jit
def _chunk_state_kernel(
    k_ptr, w_ptr, u_ptr, cum_ptr, delta_ptr, chunk_state_ptr,
    state_ptr, slots_ptr, query_start_loc_ptr, has_initial_ptr, first_chunk_ptr,
    k_stride_t, k_stride_h, s_stride_s, s_stride_h, s_stride_k, s_stride_v,
    num_v_heads, group, dk, dv,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, value head, Dv tile): the chunks in order, S in fp32
    registers; each chunk's starting state and deltas go to scratch for the output kernel.
    W S takes DOT_DTYPE operands (S rounded to it only as that factor); the update of S
    takes fp32 ones."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot < 0:  # a padded sequence: no state (the output kernel writes its zeros)
        return
    start = tl.load(query_start_loc_ptr + seq)
    end = tl.load(query_start_loc_ptr + seq + 1)
    chunk = tl.load(first_chunk_ptr + seq)
    idx = tl.arange(0, ROWS)
    kcols = tl.arange(0, BLOCK_K)
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_offset = (head // group) * k_stride_h
    state, state_ptrs, state_mask = _load_state(
        state_ptr, slot, head, tl.load(has_initial_ptr + seq), kcols, vcols, dk, dv,
        s_stride_s, s_stride_h, s_stride_k, s_stride_v, BLOCK_K, BLOCK_V,
    )  # fmt: skip
    for chunk_start in range(start, end, CHUNK):
        ptrs = _chunk_state_ptrs(chunk_state_ptr, chunk, head, num_v_heads, kcols, vcols, dk, dv)
        tl.store(ptrs, state.to(chunk_state_ptr.dtype.element_ty), mask=state_mask)
        last = tl.minimum(end, chunk_start + CHUNK) - 1
        cum_last = tl.load(cum_ptr + last.to(tl.int64) * num_v_heads + head)
        # Row blocks of the chunk one at a time (their deltas all read the starting state):
        # a block's [ROWS, Dk] tiles of W and K, not the chunk's, are live at once.
        next_state = state * tl.exp(cum_last)
        state_operand = mma_operand(state, DOT_DTYPE, INTERPRETED)
        for block in tl.static_range(CHUNK // ROWS):
            rows = (chunk_start + block * ROWS + idx).to(tl.int64)
            valid = rows < end
            token_head = rows * num_v_heads + head
            w = load_tile(w_ptr, token_head, valid, dk, 0, kcols, dk)
            w = mma_operand(w, DOT_DTYPE, INTERPRETED)  # as stored when that is DOT_DTYPE
            u = load_rows(u_ptr, token_head, valid, dv, 0, vcols, dv)
            delta = u - tl.dot(w, state_operand, input_precision=PRECISION)
            store_rows(delta_ptr, rows, valid, num_v_heads, head, vcols, dv, delta)
            cum = tl.load(cum_ptr + token_head, mask=valid, other=0.0)
            k = load_rows(k_ptr, rows, valid, k_stride_t, k_offset, kcols, dk)
            k = l2_normalize(k, 1, L2NORM) * tl.where(valid, tl.exp(cum_last - cum), 0.0)[:, None]
            # fp32 operands: bf16 keys and deltas here doubled the state's error (CPU tests)
            next_state = tl.dot(tl.trans(k), delta, next_state, input_precision=PRECISION)
        state = next_state
        chunk += 1
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, cum_ptr, delta_ptr, chunk_state_ptr, o_ptr,
    slots_ptr, chunk_start_ptr, chunk_end_ptr, chunk_seq_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, o_stride_t, o_stride_h,
    num_v_heads, group, dk, dv, scale,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """One program per (chunk, value head, Dv tile): the chunk's outputs from its starting
    state and deltas (products on DOT_DTYPE operands, fp32 accumulate)."""
    chunk, head, key_head, start, end = chunk_program(chunk_start_ptr, chunk_end_ptr, group)
    idx = tl.arange(0, CHUNK)
    rows = (start + idx).to(tl.int64)
    valid = rows < end
    kcols = tl.arange(0, BLOCK_K)
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    out_ptrs = o_ptr + rows[:, None] * o_stride_t + head * o_stride_h + vcols[None, :]
    out_mask = valid[:, None] & (vcols[None, :] < dv)
    if tl.load(slots_ptr + tl.load(chunk_seq_ptr + chunk)) < 0:  # a padded sequence
        tl.store(out_ptrs, tl.zeros([CHUNK, BLOCK_V], dtype=o_ptr.dtype.element_ty), mask=out_mask)
        return

    token_head = rows * num_v_heads + head
    cum = tl.load(cum_ptr + token_head, mask=valid, other=0.0)
    q = load_rows(q_ptr, rows, valid, q_stride_t, key_head * q_stride_h, kcols, dk)
    q = l2_normalize(q, 1, L2NORM) * scale
    k = load_rows(k_ptr, rows, valid, k_stride_t, key_head * k_stride_h, kcols, dk)
    k = mma_operand(l2_normalize(k, 1, L2NORM), DOT_DTYPE, INTERPRETED)
    qk = tl.dot(mma_operand(q, DOT_DTYPE, INTERPRETED), tl.trans(k), input_precision=PRECISION)
    causal = idx[:, None] >= idx[None, :]
    # exp only where i >= j: the cumulative log decay falls, so those ratios are <= 1.
    qk *= tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))

    ptrs = _chunk_state_ptrs(chunk_state_ptr, chunk, head, num_v_heads, kcols, vcols, dk, dv)
    state_mask = (kcols[:, None] < dk) & (vcols[None, :] < dv)
    chunk_state = mma_operand(tl.load(ptrs, mask=state_mask, other=0.0), DOT_DTYPE, INTERPRETED)
    delta = load_tile(delta_ptr, token_head, valid, dv, 0, vcols, dv)
    q = mma_operand(q * tl.exp(cum)[:, None], DOT_DTYPE, INTERPRETED)
    o = tl.dot(q, chunk_state, input_precision=PRECISION)
    qk = mma_operand(qk, DOT_DTYPE, INTERPRETED)
    o = tl.dot(qk, mma_operand(delta, DOT_DTYPE, INTERPRETED), o, input_precision=PRECISION)
    tl.store(out_ptrs, o.to(o_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    state_ptr, slots_ptr, query_start_loc_ptr, has_initial_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    g_stride_t, g_stride_h, beta_stride_t, beta_stride_h, o_stride_t, o_stride_h,
    s_stride_s, s_stride_h, s_stride_k, s_stride_v,
    group, dk, dv, scale,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, value head, Dv tile): token by token, S in registers."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // group
    start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    kcols = tl.arange(0, BLOCK_K)
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kcols < dk
    vmask = vcols < dv
    o_head = o_ptr + head * o_stride_h + vcols

    if slot < 0:  # a padded sequence (CUDA-graph batch): zero outputs, no state
        for t in range(start, end):
            zeros = tl.zeros([BLOCK_V], dtype=o_ptr.dtype.element_ty)
            tl.store(o_head + t * o_stride_t, zeros, mask=vmask)
        return

    state, state_ptrs, state_mask = _load_state(
        state_ptr, slot, head, tl.load(has_initial_ptr + seq), kcols, vcols, dk, dv,
        s_stride_s, s_stride_h, s_stride_k, s_stride_v, BLOCK_K, BLOCK_V,
    )  # fmt: skip
    for t in range(start, end):
        k = tl.load(k_ptr + t * k_stride_t + key_head * k_stride_h + kcols, mask=kmask, other=0.0)
        k = l2_normalize(k.to(tl.float32), 0, L2NORM)
        q = tl.load(q_ptr + t * q_stride_t + key_head * q_stride_h + kcols, mask=kmask, other=0.0)
        q = l2_normalize(q.to(tl.float32), 0, L2NORM) * scale
        v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + vcols, mask=vmask, other=0.0)
        g = tl.load(g_ptr + t * g_stride_t + head * g_stride_h).to(tl.float32)
        beta = tl.load(beta_ptr + t * beta_stride_t + head * beta_stride_h).to(tl.float32)

        state = state * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(k[:, None] * state, axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, axis=0)
        tl.store(o_head + t * o_stride_t, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)


def _check_inputs(q, k, v, g, beta, state, state_slots, query_start_loc, has_initial_state):
    """Shapes only (no device sync, so a decode step stays capturable in a CUDA graph)."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"gated_delta_rule: {what}")

    require(q.dim() == 3 and k.shape == q.shape, f"q {tuple(q.shape)} and k {tuple(k.shape)} "
            "must both be [T, Hk, Dk]")  # fmt: skip
    num_tokens, num_k_heads, dk = q.shape
    require(
        v.dim() == 3 and v.shape[0] == num_tokens,
        f"v {tuple(v.shape)} must be [T={num_tokens}, Hv, Dv]",
    )
    _, num_v_heads, dv = v.shape
    require(num_v_heads % num_k_heads == 0,
            f"Hv={num_v_heads} (v) must be a multiple of Hk={num_k_heads} (q, k)")  # fmt: skip
    for name, x in (("g", g), ("beta", beta)):
        require(tuple(x.shape) == (num_tokens, num_v_heads),
                f"{name} {tuple(x.shape)} must be [T={num_tokens}, Hv={num_v_heads}]")  # fmt: skip
    require(g.dtype == torch.float32, f"g must be float32, got {g.dtype}")
    require(state.dtype in STATE_DTYPES,
            f"state must be float32, bfloat16 or float16, got {state.dtype}")  # fmt: skip
    require(state.dim() == 4 and tuple(state.shape[1:]) == (num_v_heads, dk, dv),
            f"state {tuple(state.shape)} must be [S, Hv={num_v_heads}, Dk={dk}, Dv={dv}]")  # fmt: skip
    check_varlen_batch("gated_delta_rule", state_slots, query_start_loc, has_initial_state)
    for name, x in (("q", q), ("k", k), ("v", v)):
        require(
            x.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"
        )


def _staged_prepare(k, v, g, beta, w, u, cum, chunk_starts, chunk_ends, strides, num_v_heads,
                    group, shape_args, input_dots, launch):  # fmt: skip
    """W, U and the in-chunk log decay by ChunkLaunch(prepare="staged"): each chunk's
    scaled inverses into [T, Hv, C] scratch in the input dtype, then the products."""
    num_tokens, _, dk = k.shape
    dv = v.shape[2]
    grid = (chunk_starts.shape[0], num_v_heads)
    chunk = shape_args["CHUNK"]
    inv_w = torch.empty(num_tokens, num_v_heads, chunk, dtype=v.dtype, device=v.device)
    inv_u = torch.empty_like(inv_w)
    chunk_inverse_kernel[grid](
        k, g, beta, inv_w, inv_u, cum, chunk_starts, chunk_ends, *strides[:2], *strides[4:],
        num_v_heads, group, dk, **shape_args, **input_dots, num_warps=launch.prepare_warps,
    )  # fmt: skip
    block_v = max(triton.next_power_of_2(dv), 16)
    block_k = shape_args["BLOCK_K"]
    chunk_apply_kernel[grid](
        k, v, inv_w, inv_u, w, u, chunk_starts, chunk_ends, *strides[:4], num_v_heads, group,
        dk, dv, CHUNK=chunk, BLOCK_K=block_k, BLOCK_V=block_v, TILE_K=min(block_k, APPLY_TILE),
        TILE_V=min(block_v, APPLY_TILE), PRECISION=shape_args["PRECISION"], **input_dots,
        num_warps=launch.apply_warps,
    )  # fmt: skip


def _chunk_bounds(
    query_start_loc: torch.Tensor, chunk: int, max_query_len: int | None
) -> tuple[torch.Tensor, ...]:
    """Every chunk's first token, its sequence's end and its sequence, and every sequence's
    first chunk (int32, one host sync and one copy). Where the host bounds every sequence
    within one chunk (a speculative verify step), each sequence is its chunk: views of
    query_start_loc, no sync, so a CUDA graph can capture the step."""
    if max_query_len is not None and max_query_len <= chunk:
        num_seqs = query_start_loc.shape[0] - 1
        seqs = torch.arange(num_seqs, dtype=torch.int32, device=query_start_loc.device)
        return query_start_loc[:-1], query_start_loc[1:], seqs, seqs
    bounds = query_start_loc.tolist()
    starts, ends, seqs, first_chunks = [], [], [], []
    for seq, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        first_chunks.append(len(starts))
        for chunk_start in range(begin, end, chunk):
            starts.append(chunk_start)
            ends.append(end)
            seqs.append(seq)
    both = torch.tensor(starts + ends + seqs + first_chunks, dtype=torch.int32,
                        device=query_start_loc.device)  # fmt: skip
    return both.split([len(starts)] * 3 + [len(first_chunks)])


# Capturable: the decode batches a CUDA graph captures (one token per sequence) take the
# recurrent kernel, which never waits on the host; the chunked path reads the lengths only
# where max_query_len does not fit a chunk (of the default size).
@register(GATED_DELTA_RULE_OP, "triton")
@capturable_up_to(DEFAULT_CHUNK)
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    max_query_len: int | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """o [T, Hv, Dv] in v.dtype for a varlen batch; state[state_slots[b]] updated in place.

    q, k [T, Hk, Dk]; v [T, Hv, Dv] (value head h reads key head h // (Hv // Hk)); g, beta
    [T, Hv] (g float32, the log decay); state [S, Hv, Dk, Dv] float32; state_slots,
    has_initial_state [B]; query_start_loc [B+1]. A negative slot marks a padded sequence
    (zero outputs, no state read or written). A batch of one token per sequence (T == B)
    runs the recurrent kernel without a host sync; any other runs the chunked kernels, which
    read the lengths on the host unless max_query_len (the host's bound) fits one chunk.
    """
    _check_inputs(q, k, v, g, beta, state, state_slots, query_start_loc, has_initial_state)
    if chunk_size not in (16, 32, MAX_CHUNK):
        raise ValueError(f"gated_delta_rule: chunk_size={chunk_size} must be 16, 32 or 64")
    num_tokens, num_k_heads, dk = q.shape
    _, num_v_heads, dv = v.shape
    num_seqs = state_slots.shape[0]
    o = torch.empty_like(v)
    if num_tokens == 0 or num_seqs == 0:
        return o
    group = num_v_heads // num_k_heads
    # tl.dot takes tiles of at least 16 a side
    block_k = max(triton.next_power_of_2(dk), 16)
    full_v = max(triton.next_power_of_2(dv), 16)
    common_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    state_strides = state.stride()

    if num_tokens == num_seqs:
        block_v = DECODE_LAUNCH.tile_v(num_seqs, num_v_heads, full_v)
        grid = (num_seqs, num_v_heads, triton.cdiv(dv, block_v))
        _recurrent_kernel[grid](
            q, k, v, g, beta, o, state, state_slots, query_start_loc, has_initial_state,
            *common_strides, v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), *state_strides,
            group, dk, dv, scale, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
            num_warps=DECODE_LAUNCH.num_warps,
        )  # fmt: skip
        return o

    launch = chunk_launch(num_seqs, num_v_heads, dv, v.device)
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    chunk_starts, chunk_ends, chunk_seqs, first_chunks = _chunk_bounds(
        query_start_loc, chunk_size, max_query_len
    )
    num_chunks = chunk_starts.shape[0]
    wu = dict(dtype=v.dtype if launch.low_precision_wu else torch.float32, device=v.device)
    w = torch.empty(num_tokens, num_v_heads, dk, **wu)
    u = torch.empty(num_tokens, num_v_heads, dv, **wu)
    deltas = dict(dtype=v.dtype if launch.low_precision_deltas else torch.float32, device=v.device)
    delta = torch.empty(num_tokens, num_v_heads, dv, **deltas)
    chunk_states = torch.empty(num_chunks, num_v_heads, dk, dv, **deltas)
    cum = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=v.device)
    shape_args = dict(CHUNK=chunk_size, BLOCK_K=block_k, L2NORM=use_qk_l2norm, PRECISION=precision)
    # Triton's interpreter (CPU tensors) multiplies bf16 tiles wrongly: see mma_operand.
    interpreted = v.device.type == "cpu"
    input_dots = dict(DOT_DTYPE=DOT_DTYPES[v.dtype], INTERPRETED=interpreted)
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
               beta.stride(0), beta.stride(1))  # fmt: skip
    if launch.prepare == "staged":
        _staged_prepare(k, v, g, beta, w, u, cum, chunk_starts, chunk_ends, strides,
                        num_v_heads, group, shape_args, input_dots, launch)  # fmt: skip
    else:
        chunk_prepare_kernel[(num_chunks, num_v_heads)](
            k, v, g, beta, w, u, cum, chunk_starts, chunk_ends, *strides,
            num_v_heads, group, dk, dv, BLOCK_V=full_v, **shape_args,
            num_warps=launch.prepare_warps,
        )  # fmt: skip
    dots = input_dots if launch.low_precision_dots else dict(input_dots, DOT_DTYPE=tl.float32)
    block_v = min(full_v, launch.state_block_v)
    _chunk_state_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, block_v))](
        k, w, u, cum, delta, chunk_states, state, state_slots, query_start_loc,
        has_initial_state, first_chunks, k.stride(0), k.stride(1), *state_strides,
        num_v_heads, group, dk, dv, BLOCK_V=block_v, ROWS=min(launch.state_rows, chunk_size),
        **shape_args, **dots, num_warps=launch.state_warps, num_stages=launch.state_stages,
    )  # fmt: skip
    block_v = min(full_v, launch.output_block_v)
    _chunk_output_kernel[(num_chunks, num_v_heads, triton.cdiv(dv, block_v))](
        q, k, cum, delta, chunk_states, o, state_slots, chunk_starts, chunk_ends, chunk_seqs,
        *common_strides, o.stride(0), o.stride(1), num_v_heads, group, dk, dv, scale,
        BLOCK_V=block_v, **shape_args, **dots,
        num_warps=launch.output_warps,
    )  # fmt: skip
    return o
