"""Depthwise causal conv1d over a varlen batch (Gated DeltaNet's short convolution) on GPUs.

    y_t = act(bias + sum_j weight[:, j] * x_{t-K+1+j})

where a sequence's inputs before its first new token come from its slot of the conv-state
pool (the last K-1 inputs it saw, oldest first), or are zeros when it starts fresh. After
the call the slot holds the sequence's last K-1 inputs.

A prefill convolves every token in parallel (each reads its past from the tokens before it
or from the old state), then a second launch writes the new states: in one launch a late
token block could overwrite a state an early block has yet to read. A decode batch (one
token per sequence) does both in one program per (sequence, channel block). A negative
slot marks a padded sequence: its past is zeros, its state is not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.kernels.causal_conv1d import CAUSAL_CONV1D_OP
from atom.kernels.policy import capturable, register

ACTIVATIONS = (None, "silu")
BLOCK_T = 16
BLOCK_C = 128


@triton.jit
def _activate(y, SILU: tl.constexpr):
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _conv_kernel(
    x_ptr, weight_ptr, bias_ptr, y_ptr, state_ptr, slots_ptr, query_start_loc_ptr,
    has_initial_ptr, seq_of_token_ptr,
    num_tokens, channels, x_stride_t, y_stride_t, w_stride_c, w_stride_k,
    s_stride_s, s_stride_c, s_stride_k,
    KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program per (token block, channel block); tokens of any sequences."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_ok = tokens < num_tokens
    channel_ok = channels_ < channels
    seq = tl.load(seq_of_token_ptr + tokens, mask=token_ok, other=0)
    start = tl.load(query_start_loc_ptr + seq, mask=token_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=token_ok, other=-1).to(tl.int64)
    has_past = (tl.load(has_initial_ptr + seq, mask=token_ok, other=0) != 0) & (slot >= 0)

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels_, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL):
        src = tokens - (KERNEL - 1) + j
        in_seq = src >= start
        from_x = token_ok & in_seq
        x_ptrs = x_ptr + src.to(tl.int64)[:, None] * x_stride_t + channels_[None, :]
        tap = tl.load(x_ptrs, mask=from_x[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
        # before the sequence: state column K-1 + (src - start), in [0, K-2]
        from_state = token_ok & ~in_seq & has_past
        s_ptrs = (
            state_ptr
            + slot[:, None] * s_stride_s
            + channels_[None, :] * s_stride_c
            + (KERNEL - 1 + src - start)[:, None] * s_stride_k
        )
        past = tl.load(s_ptrs, mask=from_state[:, None] & channel_ok[None, :], other=0.0)
        tap += past.to(tl.float32)
        w = tl.load(weight_ptr + channels_ * w_stride_c + j * w_stride_k, mask=channel_ok)
        acc += tap * w.to(tl.float32)[None, :]
    y = _activate(acc, SILU)
    y_ptrs = y_ptr + tokens.to(tl.int64)[:, None] * y_stride_t + channels_[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=token_ok[:, None] & channel_ok[None, :])


@triton.jit
def _update_state_kernel(
    x_ptr, state_ptr, slots_ptr, query_start_loc_ptr, has_initial_ptr,
    channels, x_stride_t, s_stride_s, s_stride_c, s_stride_k,
    KERNEL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, channel block): the slot's new last K-1 inputs."""
    seq = tl.program_id(0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - start
    past_len = tl.where(tl.load(has_initial_ptr + seq) != 0, KERNEL - 1, 0)
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_K)
    # column i takes the input at position num_new - (K-1) + i of the sequence's new tokens;
    # a negative position is still in the old state, which shifts left by num_new
    position = num_new - (KERNEL - 1) + cols
    col_ok = cols < KERNEL - 1
    mask = channels_[:, None] < channels
    from_x = mask & (col_ok & (position >= 0))[None, :]
    x_ptrs = x_ptr + (start + position).to(tl.int64)[None, :] * x_stride_t + channels_[:, None]
    new = tl.load(x_ptrs, mask=from_x, other=0.0).to(state_ptr.dtype.element_ty)
    state_ptrs = state_ptr + slot * s_stride_s + channels_[:, None] * s_stride_c
    from_state = mask & (col_ok & (position < 0) & (position >= -past_len))[None, :]
    old_ptrs = state_ptrs + (KERNEL - 1 + position)[None, :] * s_stride_k
    new += tl.load(old_ptrs, mask=from_state, other=0.0)
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(state_ptrs + cols[None, :] * s_stride_k, new, mask=mask & col_ok[None, :])


@triton.jit
def _decode_kernel(
    x_ptr, weight_ptr, bias_ptr, y_ptr, state_ptr, slots_ptr, query_start_loc_ptr,
    has_initial_ptr,
    channels, x_stride_t, y_stride_t, w_stride_c, w_stride_k, s_stride_s, s_stride_c, s_stride_k,
    KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, channel block) of a one-token-per-sequence batch:
    the window is the old state plus the new input; the new state is the window minus its
    oldest column."""
    seq = tl.program_id(0)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_past = (tl.load(has_initial_ptr + seq) != 0) & (slot >= 0)
    past_len = tl.where(has_past, KERNEL - 1, 0)  # old-state columns to read
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels_ < channels
    cols = tl.arange(0, BLOCK_K)  # window columns, K-1 the new input

    x = tl.load(x_ptr + token * x_stride_t + channels_, mask=channel_ok, other=0.0)
    state_ptrs = state_ptr + slot * s_stride_s + channels_[:, None] * s_stride_c
    past_mask = channel_ok[:, None] & (cols < past_len)[None, :]
    window = tl.load(state_ptrs + cols[None, :] * s_stride_k, mask=past_mask, other=0.0)
    window = tl.where(cols[None, :] == KERNEL - 1, x[:, None].to(window.dtype), window)
    w_mask = channel_ok[:, None] & (cols < KERNEL)[None, :]
    w = tl.load(weight_ptr + channels_[:, None] * w_stride_c + cols[None, :] * w_stride_k,
                mask=w_mask, other=0.0)  # fmt: skip
    y = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + channels_, mask=channel_ok, other=0.0).to(tl.float32)
    y = _activate(y, SILU)
    tl.store(y_ptr + token * y_stride_t + channels_, y.to(y_ptr.dtype.element_ty), mask=channel_ok)

    if slot >= 0:
        # The shifted window, loaded again one column over (no register shuffles).
        shifted = cols + 1
        new_mask = channel_ok[:, None] & (shifted < past_len)[None, :]
        new = tl.load(state_ptrs + shifted[None, :] * s_stride_k, mask=new_mask, other=0.0)
        new = tl.where(shifted[None, :] == KERNEL - 1, x[:, None].to(new.dtype), new)
        tl.debug_barrier()  # every old column is read before any is overwritten
        store_mask = channel_ok[:, None] & (cols < KERNEL - 1)[None, :]
        tl.store(state_ptrs + cols[None, :] * s_stride_k, new, mask=store_mask)


def check_varlen_batch(op: str, state_slots, query_start_loc, has_initial_state) -> None:
    """The batch description both Gated DeltaNet ops take: [B] slots and flags, [B+1] bounds."""
    num_seqs = state_slots.shape[0]
    if state_slots.dim() != 1 or tuple(has_initial_state.shape) != (num_seqs,):
        raise ValueError(
            f"{op}: state_slots {tuple(state_slots.shape)} and has_initial_state "
            f"{tuple(has_initial_state.shape)} must both be [B]"
        )
    if tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"{op}: query_start_loc {tuple(query_start_loc.shape)} must be [B+1={num_seqs + 1}]"
        )


def _check_inputs(x, weight, bias, conv_state, activation):
    """Shapes only (no device sync, so a decode step stays capturable in a CUDA graph)."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"causal_conv1d: {what}")

    require(activation in ACTIVATIONS, f"activation={activation!r}, expected one of {ACTIVATIONS}")
    require(x.dim() == 2 and x.stride(-1) == 1, f"x {tuple(x.shape)} must be [T, C], "
            f"contiguous in C (strides {x.stride()})")  # fmt: skip
    channels = x.shape[1]
    require(weight.dim() == 2 and weight.shape[0] == channels and weight.shape[1] >= 2,
            f"weight {tuple(weight.shape)} must be [C={channels}, K >= 2]")  # fmt: skip
    kernel = weight.shape[1]
    require(bias is None or tuple(bias.shape) == (channels,),
            f"bias {None if bias is None else tuple(bias.shape)} must be [C={channels}]")  # fmt: skip
    require(conv_state.dim() == 3 and tuple(conv_state.shape[1:]) == (channels, kernel - 1),
            f"conv_state {tuple(conv_state.shape)} must be [S, C={channels}, K-1={kernel - 1}]")  # fmt: skip


@register(CAUSAL_CONV1D_OP, "triton")
@capturable
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """y [T, C] in x.dtype for a varlen batch; conv_state[state_slots[b]] updated in place.

    x [T, C]; weight [C, K]; bias [C] or None; conv_state [S, C, K-1]; state_slots,
    has_initial_state [B]; query_start_loc [B+1]. A batch of one token per sequence
    (T == B) runs the fused decode kernel; any other convolves, then writes the states.
    No host sync either way, so T == B is taken to mean one token each: hosts put no empty
    sequence in a step (a padded entry has its one token and slot -1).
    """
    _check_inputs(x, weight, bias, conv_state, activation)
    check_varlen_batch("causal_conv1d", state_slots, query_start_loc, has_initial_state)
    num_tokens, channels = x.shape
    kernel = weight.shape[1]
    num_seqs = state_slots.shape[0]
    y = torch.empty_like(x)
    if num_tokens == 0 or num_seqs == 0:
        return y
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    flags = dict(KERNEL=kernel, HAS_BIAS=bias is not None, SILU=activation == "silu")
    state_strides = conv_state.stride()
    channel_blocks = triton.cdiv(channels, BLOCK_C)

    if num_tokens == num_seqs:
        _decode_kernel[(num_seqs, channel_blocks)](
            x, weight, bias_arg, y, conv_state, state_slots, query_start_loc, has_initial_state,
            channels, x.stride(0), y.stride(0), weight.stride(0), weight.stride(1), *state_strides,
            BLOCK_K=triton.next_power_of_2(kernel), BLOCK_C=BLOCK_C, **flags,
        )  # fmt: skip
        return y

    token_ids = torch.arange(num_tokens, device=x.device, dtype=query_start_loc.dtype)
    seq_of_token = torch.searchsorted(query_start_loc[1:], token_ids, right=True)
    _conv_kernel[(triton.cdiv(num_tokens, BLOCK_T), channel_blocks)](
        x, weight, bias_arg, y, conv_state, state_slots, query_start_loc, has_initial_state,
        seq_of_token, num_tokens, channels, x.stride(0), y.stride(0),
        weight.stride(0), weight.stride(1), *state_strides,
        BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, **flags,
    )  # fmt: skip
    _update_state_kernel[(num_seqs, channel_blocks)](
        x, conv_state, state_slots, query_start_loc, has_initial_state,
        channels, x.stride(0), *state_strides,
        KERNEL=kernel, BLOCK_K=triton.next_power_of_2(kernel - 1), BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return y
