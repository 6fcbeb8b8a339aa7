"""The gated delta rule and the causal conv1d torch references against a naive loop over
each sequence's tokens, on varlen batches with pooled states (some sequences continuing
from a state, some starting fresh, slots out of order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom.kernels.causal_conv1d import causal_conv1d
from atom.kernels.gated_delta import gated_delta_rule
from atom.kernels.gated_delta_gates import gated_delta_gates

LENGTHS = [1, 5, 1, 9, 3]
SLOTS = [4, 0, 6, 2, 5]
HAS_STATE = [True, False, True, True, False]


def batch_tensors():
    starts = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    return (
        torch.tensor(SLOTS, dtype=torch.int32),
        starts,
        torch.tensor(HAS_STATE),
    )


def naive_gated_delta(q, k, v, g, beta, state, scale):
    """One sequence, token by token, in float64: returns (o, final state)."""
    group = v.shape[1] // k.shape[1]
    s = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        qt = F.normalize(q[t].double(), dim=-1, eps=0) * scale
        kt = F.normalize(k[t].double(), dim=-1, eps=0)
        o_t = []
        for h in range(v.shape[1]):
            kh, qh = kt[h // group], qt[h // group]
            s[h] = s[h] * torch.exp(g[t, h].double())
            kv = kh @ s[h]
            delta = (v[t, h].double() - kv) * beta[t, h].double()
            s[h] = s[h] + torch.outer(kh, delta)
            o_t.append(qh @ s[h])
        out.append(torch.stack(o_t))
    return torch.stack(out), s


@pytest.mark.parametrize(
    "heads, state_dtype",
    [((2, 2), torch.float32), ((2, 4), torch.float32), ((2, 4), torch.bfloat16)],
    ids=["mha", "grouped-values", "bf16-state"],
)
def test_gated_delta_rule_matches_a_per_token_loop(heads, state_dtype):
    """A bf16 pool (a host's mamba_ssm_cache_dtype) is read and added up in fp32, so only
    the stored state is rounded."""
    hk, hv = heads
    dk, dv = 8, 6
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total + 2, hk, dk, generator=gen)  # two rows of host padding
    k = torch.randn(total + 2, hk, dk, generator=gen)
    v = torch.randn(total + 2, hv, dv, generator=gen)
    g = -torch.rand(total + 2, hv, generator=gen) * 2
    beta = torch.rand(total + 2, hv, generator=gen)
    pool = torch.randn(8, hv, dk, dv, generator=gen).to(state_dtype)
    slots, starts, has_state = batch_tensors()
    expected_pool = pool.clone().double()
    expected = torch.zeros(total + 2, hv, dv, dtype=torch.float64)
    for i, (slot, initial) in enumerate(zip(SLOTS, HAS_STATE)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        start_state = pool[slot] if initial else torch.zeros(hv, dk, dv, dtype=state_dtype)
        o, final = naive_gated_delta(
            q[rows], k[rows], v[rows], g[rows], beta[rows], start_state, 0.3
        )
        expected[rows] = o
        expected_pool[slot] = final
    out = gated_delta_rule(q, k, v, g, beta, pool, slots, starts, has_state, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    assert pool.dtype == state_dtype
    stored = (
        dict(atol=1e-4, rtol=1e-4) if state_dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    )
    torch.testing.assert_close(pool.double(), expected_pool, **stored)
    assert out[total:].abs().max() == 0


def naive_conv(x, weight, bias, history):
    """One sequence: history [C, K-1] then x [L, C]; returns (silu(conv), last K-1 inputs)."""
    width = weight.shape[1]
    full = torch.cat([history.T, x], 0).double()
    out = []
    for t in range(x.shape[0]):
        window = full[t : t + width]  # [K, C]
        out.append((window.T * weight.double()).sum(1) + bias.double())
    return F.silu(torch.stack(out)), full[-(width - 1) :].T


def test_causal_conv1d_matches_a_per_token_loop():
    channels, width = 10, 4
    gen = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    x = torch.randn(total + 1, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    pool = torch.randn(8, channels, width - 1, generator=gen)
    slots, starts, has_state = batch_tensors()
    expected_pool = pool.clone().double()
    expected = torch.zeros(total + 1, channels, dtype=torch.float64)
    for i, (slot, initial) in enumerate(zip(SLOTS, HAS_STATE)):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        history = pool[slot] if initial else torch.zeros(channels, width - 1)
        expected[rows], expected_pool[slot] = naive_conv(x[rows], weight, bias, history)
    out = causal_conv1d(x, weight, bias, pool, slots, starts, has_state, "silu")
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.double(), expected_pool, atol=1e-6, rtol=1e-6)


def test_chunks_carry_state_like_one_pass():
    """A 9-token sequence in chunks of 4, 1, 4 (state carried) equals one pass of 9."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    q, k = torch.randn(9, 1, 4, generator=gen), torch.randn(9, 1, 4, generator=gen)
    v, g, beta = torch.randn(9, 2, 3, generator=gen), -torch.rand(9, 2), torch.rand(9, 2)
    results = []
    for chunks in ([9], [4, 1, 4]):
        conv_pool, pool = torch.zeros(2, 6, 3), torch.zeros(2, 2, 4, 3)
        ys, os_, begin = [], [], 0
        for n in chunks:
            rows = slice(begin, begin + n)
            meta = (torch.tensor([1], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                    torch.tensor([begin > 0]))  # fmt: skip
            ys.append(causal_conv1d(x[rows], weight, None, conv_pool, *meta, activation=None))
            os_.append(
                gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], pool, *meta, 0.5)
            )
            begin += n
        results.append((torch.cat(ys), torch.cat(os_), conv_pool[1], pool[1]))
    for one_pass, chunked in zip(*results):
        torch.testing.assert_close(chunked, one_pass, atol=1e-5, rtol=1e-5)


def test_unknown_activation_is_rejected():
    with pytest.raises(ValueError, match="activation='gelu'"):
        causal_conv1d(torch.zeros(1, 2), torch.zeros(2, 4), None, torch.zeros(1, 2, 3),
                      *batch_tensors(), activation="gelu")  # fmt: skip


@pytest.mark.parametrize("num_tokens", [0, 5])
def test_gates_of_grouped_projections_follow_their_formulas(num_tokens):
    """The gates' torch op: value heads grouped by key head ([T, Hk, Hv / Hk], as
    Qwen3-Next's projection leaves them) read in head order; a step of no tokens too."""
    generator = torch.Generator().manual_seed(3)
    b, a = torch.randn(num_tokens, 2, 6, generator=generator).split(3, dim=-1)
    A_log, dt_bias = torch.randn(2, 6, generator=generator)
    g, beta = gated_delta_gates(a, b, A_log, dt_bias)
    flat_a, flat_b = a.reshape(num_tokens, 6).double(), b.reshape(num_tokens, 6).double()
    want_g = -A_log.double().exp() * torch.log1p((flat_a + dt_bias.double()).exp())
    torch.testing.assert_close(g.double(), want_g, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(beta.double(), 1 / (1 + (-flat_b).exp()), rtol=1e-6, atol=1e-7)
