"""The Triton gated delta rule (chunked prefill, recurrent decode) against a naive per-token loop.

The reference below is the recurrence itself, token by token in fp64; one test pins it to
HF transformers' Qwen3-Next functions, so the kernels follow HF's conventions (l2norm eps
inside the square root, scale on q after the norm, value head h reading key head
h // (Hv // Hk)). Every batch scatters its sequences over a pool of state slots whose other
slots, and the slots of sequences that start fresh, hold NaN: the kernels must neither
read nor write them.

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise) with
small heads and chunks of 16, so sequences span several chunks and end inside one (and
chunks of 64 under other launch configs of the prefill kernels); the `gpu` cases run
Qwen3-Next's shapes (Dk = Dv = 128, 16 key / 32 value heads) in bf16 with the default
chunk of 64.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import gated_delta as triton_gated_delta  # noqa: E402
from atom.kernels.triton.gated_delta import (  # noqa: E402
    ChunkLaunch,
    DecodeLaunch,
    gated_delta_rule,
)

CPU_CHUNK = 16
# fp32: the kernels against the fp64 loop (tf32 is off for fp32 inputs). bf16: the inputs
# are rounded to bf16 before either side sees them, so what differs is the bf16 output
# (2^-8 relative) and, on the GPU, the tf32 matmuls of the chunked form.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
STATE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def naive_gated_delta(q, k, v, g, beta, pool, slots, lens, has_initial, scale, use_l2norm):
    """fp64, token by token: the outputs [T, Hv, Dv] and the pool after the batch."""
    pool = pool.double().clone()
    group = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(group, dim=1) for x in (q, k))
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    v, g, beta = v.double(), g.double(), beta.double()
    out = torch.zeros_like(v)
    start = 0
    for slot, n, has in zip(slots, lens, has_initial):
        s = pool[slot].clone() if has and slot >= 0 else torch.zeros_like(pool[0])  # [Hv, Dk, Dv]
        for t in range(start, start + n):
            s = s * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, s)
        if slot >= 0:
            pool[slot] = s
        start += n
    return out, pool


def make_batch(lens, hk, hv, dk, dv, dtype, has_initial, num_slots=None, seed=0,
               unit_keys=False):  # fmt: skip
    """Inputs as a Qwen3-Next layer makes them, sequences scattered over the pool's slots."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_seqs = sum(lens), len(lens)
    num_slots = num_slots or 2 * num_seqs + 1
    q = torch.randn(num_tokens, hk, dk, generator=gen)
    k = torch.randn(num_tokens, hk, dk, generator=gen)
    if unit_keys:  # without the in-kernel norm, keep |k|^2 beta < 2 so the rule is stable
        q, k = q / dk**0.5, k / dk**0.5
    v = torch.randn(num_tokens, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(num_tokens, hv, generator=gen))  # log decay in (-inf, 0)
    beta = torch.sigmoid(torch.randn(num_tokens, hv, generator=gen))
    slots = torch.randperm(num_slots, generator=gen)[:num_seqs].to(torch.int32)
    pool = torch.full((num_slots, hv, dk, dv), float("nan"))
    for slot, has in zip(slots.tolist(), has_initial):
        if has:
            pool[slot] = torch.randn(hv, dk, dv, generator=gen) * 0.5
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, state=pool, state_slots=slots, query_start_loc=cu,
        has_initial_state=torch.tensor(has_initial),
    )  # fmt: skip


def to_device(batch):
    return {name: x.to(DEVICE) for name, x in batch.items()}


def run_both(batch, lens, scale, use_l2norm=True, chunk_size=CPU_CHUNK):
    """(kernel outputs, kernel pool) and (reference outputs, reference pool), on the CPU."""
    args = to_device(batch)
    want_o, want_pool = naive_gated_delta(
        *(args[n] for n in ("q", "k", "v", "g", "beta", "state")),
        batch["state_slots"].tolist(), lens, batch["has_initial_state"].tolist(), scale,
        use_l2norm,
    )  # fmt: skip
    got_o = gated_delta_rule(**args, scale=scale, use_qk_l2norm=use_l2norm, chunk_size=chunk_size)
    return (got_o.cpu(), args["state"].cpu()), (want_o.cpu(), want_pool.cpu())


def check(got, want, dtype):
    (got_o, got_pool), (want_o, want_pool) = got, want
    assert got_o.dtype == dtype
    torch.testing.assert_close(got_o.double(), want_o, **TOL[dtype])
    torch.testing.assert_close(got_pool.double(), want_pool, equal_nan=True, **STATE_TOL[dtype])


def test_reference_is_hf_qwen3_next():
    """The naive loop equals transformers' recurrent and chunked functions, GQA and all."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    lens, hk, hv, dk, dv = [45], 2, 4, 32, 16
    batch = make_batch(lens, hk, hv, dk, dv, torch.float32, has_initial=[True], num_slots=1)
    want_o, want_pool = naive_gated_delta(
        *(batch[n] for n in ("q", "k", "v", "g", "beta", "state")), [0], lens, [True],
        dk**-0.5, True,
    )  # fmt: skip
    # Key heads repeated per value head, as HF's layer does before these functions (only
    # some transformers versions repeat them inside).
    q, k = (batch[n].repeat_interleave(hv // hk, dim=1) for n in ("q", "k"))
    hf_args = [x[None] for x in (q, k, batch["v"], batch["g"], batch["beta"])]
    for hf in (modeling.torch_recurrent_gated_delta_rule, modeling.torch_chunk_gated_delta_rule):
        o, final = hf(*hf_args, initial_state=batch["state"].clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)  # fmt: skip
        torch.testing.assert_close(o[0].double(), want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), want_pool, atol=1e-5, rtol=1e-5)


CPU_CASES = {
    # lengths, has_initial_state, Hk, Hv, Dk, Dv
    "mixed, GQA 2": ([1, 5, 16, 37], [True, False, True, False], 2, 4, 32, 32),
    "decodes among prefills": ([37, 1, 16, 1], [True, True, False, True], 2, 2, 32, 32),
    "GQA 4, odd dims": ([20, 33], [False, True], 1, 4, 24, 40),
}


@pytest.mark.parametrize("use_l2norm", [True, False])
@pytest.mark.parametrize("case", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_prefill(case, use_l2norm):
    lens, has_initial, hk, hv, dk, dv = case
    batch = make_batch(lens, hk, hv, dk, dv, torch.float32, has_initial,
                       unit_keys=not use_l2norm)  # fmt: skip
    check(*run_both(batch, lens, dk**-0.5, use_l2norm), torch.float32)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_prefill_larger_chunks(chunk_size):
    """Chunks of two and four [16, 16] blocks of (I + A)^-1 (64: the models' default), full
    ones and partial ones."""
    lens = [70, 3]
    batch = make_batch(lens, 1, 2, 32, 32, torch.float32, [True, False], seed=5)
    check(*run_both(batch, lens, 32**-0.5, chunk_size=chunk_size), torch.float32)


LAUNCHES = {  # through the hook benchmarks/gated_delta.py --sweep uses
    # the defaults of a batch too small for the wide state tile to fill the SMs (on CPU
    # the default is always the wide one)
    "narrow-state default": triton_gated_delta.NARROW_STATE_LAUNCH,
    "narrow tiles": ChunkLaunch(state_block_v=16, output_block_v=16, state_warps=2),
    "wide tiles, whole chunk rows": ChunkLaunch(state_block_v=64, output_block_v=128,
                                                state_rows=64, state_stages=3),
    "fp32 scratch, half chunk rows": ChunkLaunch(state_rows=32, low_precision_wu=False,
                                                 low_precision_deltas=False),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", LAUNCHES.values(), ids=LAUNCHES.keys())
def test_prefill_launch_configs(launch, dtype, monkeypatch):
    """The state and output kernels at other Dv tiles (Dv = 48: one to three tiles, the last
    partial), row blocks and scratch dtypes, with the models' chunk of 64: sequences of
    several chunks, ending inside one, with and without an initial state."""
    monkeypatch.setattr(triton_gated_delta, "CHUNK_LAUNCH", launch)
    lens = [16, 150, 5, 64]
    batch = make_batch(lens, 2, 4, 32, 48, dtype, [True, False, True, False], seed=6)
    check(*run_both(batch, lens, 32**-0.5, chunk_size=64), dtype)


# The chunk-local kernels ChunkLaunch(prepare=...) selects, and the input-dtype products of
# the state and output kernels: every variant beside today's default.
VARIANTS = {
    "fused": dict(prepare="fused", low_precision_dots=False),
    "fused, input-dtype dots": dict(prepare="fused"),
    "staged, fp32 dots": dict(low_precision_dots=False),
}


def use_variant(monkeypatch, fields):
    """The rule's default launches (narrow and wide state tiles) with `fields` changed."""
    for name in ("NARROW_STATE_LAUNCH", "WIDE_STATE_LAUNCH"):
        launch = getattr(triton_gated_delta, name)
        monkeypatch.setattr(triton_gated_delta, name, replace(launch, **fields))


# (variant, chunk size, dtype): the fused prepare at the smallest and the largest chunk;
# the input-dtype products (state and output kernels, which do not depend on how the
# prepare step is split) where they round: bf16 inputs. Few cases: the interpreter is slow.
VARIANT_CASES = {
    "fused, chunk 16, fp32": (VARIANTS["fused"], 16, torch.float32),
    "fused, chunk 64, bf16": (VARIANTS["fused"], 64, torch.bfloat16),
    "staged, fp32 dots, chunk 64, bf16": (VARIANTS["staged, fp32 dots"], 64, torch.bfloat16),
    "fused, input-dtype dots, chunk 64, bf16": (
        VARIANTS["fused, input-dtype dots"], 64, torch.bfloat16,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "variant, chunk_size, dtype", VARIANT_CASES.values(), ids=VARIANT_CASES.keys()
)
def test_prefill_variants(variant, chunk_size, dtype, monkeypatch):
    """The variants at odd dims (Dk = 24, Dv = 40: partial tiles), GQA 2, sequences of one
    token, of several chunks and ending inside one, with and without an initial state."""
    use_variant(monkeypatch, variant)
    lens, has_initial = [1, 70, 16, 23], [True, False, True, False]
    batch = make_batch(lens, 1, 2, 24, 40, dtype, has_initial, seed=8)
    check(*run_both(batch, lens, 24**-0.5, chunk_size=chunk_size), dtype)


def test_fused_prepare_without_l2norm(monkeypatch):
    use_variant(monkeypatch, VARIANTS["fused"])
    lens = [5, 37]
    batch = make_batch(lens, 2, 4, 32, 32, torch.float32, [False, True], unit_keys=True, seed=9)
    check(*run_both(batch, lens, 32**-0.5, use_l2norm=False), torch.float32)


def test_prefill_bf16():
    lens = [1, 5, 16, 37]
    batch = make_batch(lens, 2, 4, 32, 32, torch.bfloat16, [True, False, True, False])
    check(*run_both(batch, lens, 32**-0.5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode(dtype):
    """One token per sequence: the recurrent kernel (no host sync)."""
    lens = [1] * 5
    batch = make_batch(lens, 2, 4, 32, 32, dtype, [True, False, True, True, False], seed=1)
    check(*run_both(batch, lens, 32**-0.5), dtype)


@pytest.mark.parametrize(
    "launch",
    [DecodeLaunch(block_v=8, num_warps=1), DecodeLaunch(block_v=64, num_warps=2)],
    ids=["8-wide", "64-wide"],
)
def test_decode_launch_configs(launch, monkeypatch):
    """The recurrent kernel at other Dv tiles and warps (through the hook the sweep uses):
    Dv = 48 gives the 8-wide tile six programs a head, the 64-wide one a partial tile."""
    monkeypatch.setattr(triton_gated_delta, "DECODE_LAUNCH", launch)
    lens = [1] * 4
    batch = make_batch(lens, 2, 4, 32, 48, torch.float32, [True, False, True, True], seed=7)
    check(*run_both(batch, lens, 32**-0.5), torch.float32)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[1] * 5, [1, 5, 16, 37, 2]], ids=["decode", "prefill"])
def test_low_precision_state_pool(lens, state_dtype):
    """A host's bf16 / fp16 state pool (vLLM's mamba_ssm_cache_dtype): the kernels load it
    into fp32 and store it back rounded, so the outputs keep fp32's accuracy."""
    batch = make_batch(lens, 2, 4, 32, 32, torch.float32, [True, False, True, True, False], seed=6)
    batch["state"] = batch["state"].to(state_dtype)
    (got_o, got_pool), (want_o, want_pool) = run_both(batch, lens, 32**-0.5)
    assert got_pool.dtype == state_dtype
    torch.testing.assert_close(got_o.double(), want_o, **TOL[torch.float32])
    torch.testing.assert_close(
        got_pool.double(), want_pool, equal_nan=True, **STATE_TOL[torch.bfloat16]
    )


@pytest.mark.parametrize("lens", [[1, 1, 1], [20, 37, 5]], ids=["decode", "prefill"])
def test_padded_sequence(lens):
    """A negative slot (a padded CUDA-graph entry): zero outputs, the pool untouched."""
    batch = make_batch(lens, 2, 2, 32, 32, torch.float32, [True] * len(lens), seed=2)
    batch["state_slots"][1] = -1
    (got_o, got_pool), (want_o, want_pool) = run_both(batch, lens, 32**-0.5)
    padded = slice(lens[0], lens[0] + lens[1])
    assert torch.equal(got_o[padded], torch.zeros_like(got_o[padded]))
    want_o[padded] = 0
    check((got_o, got_pool), (want_o, want_pool), torch.float32)


@pytest.mark.parametrize("lens", [[4, 4, 4], [3, 16, 1]], ids=["verify", "within a chunk"])
def test_bounded_batch_reads_no_lengths_on_the_host(lens, monkeypatch):
    """With max_query_len within a chunk (a speculative verify step, k + 1 tokens per
    sequence) the chunked path plans from query_start_loc on the device, as a CUDA graph
    needs: same results, and the lengths are never read on the host."""
    batch = make_batch(lens, 2, 4, 32, 32, torch.float32, [True, False, True], seed=3)
    args = to_device(batch)
    want_o, want_pool = naive_gated_delta(
        *(args[n] for n in ("q", "k", "v", "g", "beta", "state")),
        batch["state_slots"].tolist(), lens, batch["has_initial_state"].tolist(), 32**-0.5, True,
    )  # fmt: skip

    def no_host_read(*_):
        raise AssertionError("query_start_loc read on the host")

    monkeypatch.setattr(args["query_start_loc"], "tolist", no_host_read, raising=False)
    got_o = gated_delta_rule(**args, scale=32**-0.5, max_query_len=max(lens), chunk_size=CPU_CHUNK)
    check((got_o.cpu(), args["state"].cpu()), (want_o.cpu(), want_pool.cpu()), torch.float32)


def test_prefill_then_decode_equals_one_prefill():
    """Chunked prefill, a second chunked prefill from the saved state, then decodes: the
    outputs and final states of one prefill over the same tokens."""
    lens, hk, hv, dk, dv = [40, 23], 2, 4, 32, 32
    first, second, decodes = [21, 4], [16, 16], 3
    assert [a + b + decodes for a, b in zip(first, second)] == lens
    whole = make_batch(lens, hk, hv, dk, dv, torch.float32, [False, False], seed=3)
    scale = dk**-0.5
    args = to_device(whole)
    want_o = gated_delta_rule(**args, scale=scale, chunk_size=CPU_CHUNK).cpu()
    want_state = args["state"].cpu()

    pool = whole["state"].clone().to(DEVICE)
    slots, seq_starts = whole["state_slots"].to(DEVICE), [0, lens[0]]
    got_o = torch.empty_like(want_o)

    def step(offsets, counts, has_initial):
        rows = torch.cat(
            [torch.arange(s + o, s + o + n) for s, o, n in zip(seq_starts, offsets, counts)]
        )
        cu = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
        inputs = {n: whole[n][rows].to(DEVICE) for n in ("q", "k", "v", "g", "beta")}
        got_o[rows] = gated_delta_rule(
            **inputs, state=pool, state_slots=slots, query_start_loc=cu.to(DEVICE),
            has_initial_state=torch.tensor(has_initial, device=DEVICE), scale=scale,
            chunk_size=CPU_CHUNK,
        ).cpu()  # fmt: skip

    step([0, 0], first, [False, False])
    step(first, second, [True, True])
    for i in range(decodes):
        step([a + b + i for a, b in zip(first, second)], [1, 1], [True, True])
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pool.cpu(), want_state, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_bad_launch_config_names_the_field():
    with pytest.raises(ValueError, match=re.escape("ChunkLaunch: state_rows=48")):
        ChunkLaunch(state_rows=48)
    with pytest.raises(ValueError, match=re.escape("ChunkLaunch: prepare='split'")):
        ChunkLaunch(prepare="split")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(v=torch.zeros(3, 3, 16)), "Hv=3"),
        (dict(g=torch.zeros(3, 4, dtype=torch.bfloat16)), "g must be float32"),
        (dict(state=torch.zeros(2, 4, 16, 8)), "state (2, 4, 16, 8)"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "query_start_loc (2,)"),
        (dict(chunk_size=48), "chunk_size=48"),
    ],
)
def test_bad_input_names_the_field(change, message):
    args = dict(
        q=torch.zeros(3, 2, 16), k=torch.zeros(3, 2, 16), v=torch.zeros(3, 4, 16),
        g=torch.zeros(3, 4), beta=torch.zeros(3, 4), state=torch.zeros(2, 4, 16, 16),
        state_slots=torch.tensor([0, 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]), scale=0.25,
    )  # fmt: skip
    with pytest.raises(ValueError, match="gated_delta_rule: .*" + re.escape(message)):
        gated_delta_rule(**{**args, **change})


gpu = pytest.mark.skipif(DEVICE != "cuda", reason="Qwen3-Next shapes: too slow interpreted")
GPU_CASES = {
    # lengths (incl. non-multiples of the chunk and one-token prefills among them), has_initial
    "long mixed": ([4096, 1000, 1, 129, 64, 7], [False, True, True, False, True, True]),
    "decode 64": ([1] * 64, [True, False] * 32),
}


GPU_VARIANTS = {"default": {}, **VARIANTS}


@gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS.values(), ids=GPU_VARIANTS.keys())
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_qwen3_next_shapes(case, variant, monkeypatch):
    """Today's default launch and every variant (VARIANTS) at the models' shapes."""
    use_variant(monkeypatch, variant)
    lens, has_initial = case
    batch = make_batch(lens, 16, 32, 128, 128, torch.bfloat16, has_initial, seed=4)
    check(*run_both(batch, lens, 128**-0.5, chunk_size=64), torch.bfloat16)
