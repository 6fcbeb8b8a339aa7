"""The Triton causal conv1d (varlen prefill, fused decode) against a naive torch reference.

The reference concatenates each sequence's past (its conv-state slot, or zeros) with its
new inputs and slides the kernel over them in fp64. Pool slots no sequence owns, and the
slots of sequences that start fresh, hold NaN: the kernels must neither read nor write them.
On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise); the `gpu`
case runs Qwen3-Next's conv width (8192 channels) in bf16 over sequences up to 4096 tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton.causal_conv1d import causal_conv1d  # noqa: E402

# fp32: fp32 sums of K products against fp64. bf16: the inputs are bf16 on both sides, so
# what differs is the bf16 output (2^-8 relative to outputs of a few units).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1e-2)}


def naive_conv(x, weight, bias, pool, slots, lens, has_initial, activation):
    """fp64: the outputs [T, C] and the pool after the batch."""
    pool = pool.double().clone()
    kernel = weight.shape[1]
    weight = weight.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    start = 0
    for slot, n, has in zip(slots, lens, has_initial):
        past = pool[slot].T if has and slot >= 0 else pool.new_zeros(kernel - 1, x.shape[1])
        inputs = torch.cat([past, x[start : start + n].double()])  # [K-1+n, C]
        for t in range(n):
            y = (inputs[t : t + kernel].T * weight).sum(1)
            y = y + bias.double() if bias is not None else y
            out[start + t] = torch.nn.functional.silu(y) if activation == "silu" else y
        if slot >= 0:
            pool[slot] = inputs[-(kernel - 1) :].T
        start += n
    return out, pool


def make_batch(lens, channels, kernel, dtype, has_initial, with_bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(lens)
    num_slots = 2 * num_seqs + 1
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs].to(torch.int32)
    pool = torch.full((num_slots, channels, kernel - 1), float("nan"))
    for slot, has in zip(slots.tolist(), has_initial):
        if has:
            pool[slot] = torch.randn(channels, kernel - 1, generator=gen)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    return dict(
        x=torch.randn(sum(lens), channels, generator=gen).to(dtype),
        weight=(torch.randn(channels, kernel, generator=gen) / kernel**0.5).to(dtype),
        bias=bias, conv_state=pool.to(dtype), state_slots=slots,
        query_start_loc=torch.tensor([0, *lens]).cumsum(0).to(torch.int32),
        has_initial_state=torch.tensor(has_initial),
    )  # fmt: skip


def run_and_check(batch, lens, activation="silu"):
    args = {n: x.to(DEVICE) if x is not None else None for n, x in batch.items()}
    want_y, want_pool = naive_conv(
        args["x"], args["weight"], args["bias"], args["conv_state"],
        batch["state_slots"].tolist(), lens, batch["has_initial_state"].tolist(), activation,
    )  # fmt: skip
    got_y = causal_conv1d(**args, activation=activation)
    dtype = batch["x"].dtype
    assert got_y.dtype == dtype
    torch.testing.assert_close(got_y.double(), want_y, **TOL[dtype])
    # the new state is a copy of inputs: exact
    torch.testing.assert_close(
        args["conv_state"].double(), want_pool, atol=0, rtol=0, equal_nan=True
    )
    return got_y.cpu(), args["conv_state"].cpu()


CASES = {
    # lengths (a sequence with no new token keeps its state), has_initial, channels, K
    "mixed K4": ([1, 2, 5, 16, 37, 0, 3], [True, True, False, True, False, True, True], 200, 4),
    "K3, fewer tokens than K-1": ([1, 2, 40], [True, True, False], 130, 3),
    "decodes": ([1, 1, 1, 1], [True, False, True, True], 200, 4),
}


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_causal_conv1d(case, activation):
    lens, has_initial, channels, kernel = case
    run_and_check(make_batch(lens, channels, kernel, torch.float32, has_initial), lens, activation)


@pytest.mark.parametrize("lens", [[1, 1, 1], [3, 9, 4]], ids=["decode", "prefill"])
def test_bf16_without_bias(lens):
    batch = make_batch(lens, 200, 4, torch.bfloat16, [True, False, True], with_bias=False)
    run_and_check(batch, lens)


@pytest.mark.parametrize("lens", [[1, 1, 1], [3, 9, 4]], ids=["decode", "prefill"])
def test_padded_sequence(lens):
    """A negative slot (a padded CUDA-graph entry): its past is zeros, the pool untouched."""
    batch = make_batch(lens, 200, 4, torch.float32, [True] * 3, seed=1)
    batch["state_slots"][1] = -1
    run_and_check(batch, lens)


def test_prefill_then_decode_equals_one_prefill():
    """Prefill, a second prefill shorter than K-1 (the old state shifts in), then decodes:
    the outputs and final states of one prefill over the same tokens."""
    lens = [30, 11]
    whole = make_batch(lens, 200, 4, torch.float32, [False, False], seed=2)
    want_y, want_pool = run_and_check(whole, lens)
    # each step: (first token, count) of each sequence
    steps = [[(0, 20), (0, 2)], [(20, 2), (2, 1)]]
    steps += [[(22 + i, 1), (3 + i, 1)] for i in range(8)]
    assert [sum(step[b][1] for step in steps) for b in range(2)] == lens
    pool = torch.full_like(whole["conv_state"], float("nan")).to(DEVICE)
    args = {n: whole[n].to(DEVICE) for n in ("weight", "bias", "state_slots")}
    got_y = torch.full_like(want_y, float("nan"))
    for i, step in enumerate(steps):
        rows = torch.cat(
            [torch.arange(s, s + n) + offset for (s, n), offset in zip(step, [0, lens[0]])]
        )
        cu = torch.tensor([0, *(n for _, n in step)]).cumsum(0).to(torch.int32)
        got_y[rows] = causal_conv1d(
            whole["x"][rows].to(DEVICE), conv_state=pool, query_start_loc=cu.to(DEVICE),
            has_initial_state=torch.tensor([i > 0] * 2, device=DEVICE), **args,
        ).cpu()  # fmt: skip
    torch.testing.assert_close(got_y, want_y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool.cpu(), want_pool, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation="gelu"), "activation='gelu'"),
        (dict(conv_state=torch.zeros(2, 8, 2)), "conv_state (2, 8, 2)"),
        (dict(bias=torch.zeros(7)), "bias (7,)"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "query_start_loc (2,)"),
    ],
)
def test_bad_input_names_the_field(change, message):
    args = dict(
        x=torch.zeros(3, 8), weight=torch.zeros(8, 4), bias=None,
        conv_state=torch.zeros(2, 8, 3), state_slots=torch.tensor([0, 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="causal_conv1d: .*" + re.escape(message)):
        causal_conv1d(**{**args, **change})


@pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3-Next shapes: too slow interpreted")
@pytest.mark.parametrize(
    "lens", [[4096, 1000, 1, 129, 64, 2], [1] * 64], ids=["long mixed", "decode 64"]
)
def test_qwen3_next_shapes(lens):
    has_initial = [i % 3 != 1 for i in range(len(lens))]
    run_and_check(make_batch(lens, 8192, 4, torch.bfloat16, has_initial, seed=3), lens)
