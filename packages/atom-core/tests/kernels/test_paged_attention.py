"""Paged attention against dense attention over each sequence's unpaged K/V.

Batches follow docs/architecture.md: decodes first, then prefills with and without a cached
prefix; pages are scattered randomly through the pool and the K/V of every position
(context and new tokens) is in the cache before attention runs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from atom.forward_context import AttentionMetadata, set_forward_context
from atom.kernels import AttentionScoring, PagedKVCache, paged_attention, write_kv_cache
from atom.kernels.paged_attention import paged_attention_torch
from atom.layers.attention import Attention

KV_HEADS = 2
# fp32 kernel vs float64 reference: fp32 rounding over sums of up to ~60 terms.
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
# (cached context, new tokens): three decodes, then a fresh, a prefixed and a long prefill.
MIXED_BATCH = [(37, 1), (0, 1), (70, 1), (0, 13), (21, 6), (40, 17)]


@dataclass
class Batch:
    query: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], unpaged
    values: list[torch.Tensor]  # per sequence [seq_len, Hkv, Dv], unpaged
    contexts: list[int]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata

    def attend(self, scoring: AttentionScoring, **kwargs) -> torch.Tensor:
        cache = PagedKVCache(self.key_cache, self.value_cache)
        return paged_attention(self.query, cache, self.metadata, scoring, **kwargs)


def make_batch(
    seqs: list[tuple[int, int]],
    group: int,
    block_size: int,
    head_dim: int = 64,
    v_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lengths = [context + new for context, new in seqs]
    pages_needed = [-(-length // block_size) for length in lengths]
    num_pages = sum(pages_needed) + 8  # spare pages stay unused
    pool = list(range(num_pages))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in pages_needed]

    keys = [torch.randn(n, KV_HEADS, head_dim, dtype=dtype) for n in lengths]
    values = [torch.randn(n, KV_HEADS, v_dim, dtype=dtype) for n in lengths]
    key_cache = torch.zeros(num_pages, block_size, KV_HEADS, head_dim, dtype=dtype)
    value_cache = torch.zeros(num_pages, block_size, KV_HEADS, v_dim, dtype=dtype)
    slots = [
        torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)],
            dtype=torch.int64,
        )
        for table, n in zip(tables, lengths)
    ]
    write_kv_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, torch.cat(slots))

    new_slots = [s for (context, _), seq_slots in zip(seqs, slots) for s in seq_slots[context:]]
    metadata = AttentionMetadata.build([n for _, n in seqs], lengths, tables, new_slots)
    query = torch.randn(sum(n for _, n in seqs), KV_HEADS * group, head_dim, dtype=dtype)
    contexts = [context for context, _ in seqs]
    return Batch(query, keys, values, contexts, key_cache, value_cache, metadata)


def naive_attention(q, k, v, context, scale, window, soft_cap):
    """One new token at a time in float64, straight from the definition."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.double().repeat_interleave(group, dim=1)
    out = []
    for j, q_row in enumerate(q.double()):
        position = context + j
        first = 0 if window is None else max(0, position - window + 1)
        scores = torch.einsum("hd,khd->hk", q_row, k[first : position + 1]) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[first : position + 1]))
    return torch.stack(out)


def expected_output(batch: Batch, scale, window=None, soft_cap=None) -> torch.Tensor:
    starts = batch.metadata.host_query_start_loc()
    return torch.cat(
        [
            naive_attention(
                batch.query[starts[i] : starts[i + 1]], k, v, context, scale, window, soft_cap
            )
            for i, (k, v, context) in enumerate(zip(batch.keys, batch.values, batch.contexts))
            if starts[i + 1] > starts[i]
        ]
    )


VARIANTS = {"causal": (None, None), "window": (8, None), "soft_cap": (None, 2.0), "both": (8, 2.0)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_matches_naive(group, block_size, variant):
    window, soft_cap = VARIANTS[variant]
    batch = make_batch(MIXED_BATCH, group, block_size, seed=group * 31 + block_size)
    scale = 1 / math.sqrt(64)
    got = batch.attend(AttentionScoring(scale, window, soft_cap))
    want = expected_output(batch, scale, window, soft_cap)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, **FP32_TOL)


@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (128, 128), (128, 64), (192, 128)])
def test_head_dims_and_value_dim(head_dim, v_dim):
    batch = make_batch(MIXED_BATCH, 2, 16, head_dim, v_dim, seed=head_dim + v_dim)
    scale = head_dim**-0.5
    got = batch.attend(AttentionScoring(scale, sliding_window=16))
    assert got.shape == (batch.query.shape[0], batch.query.shape[1], v_dim)
    want = expected_output(batch, scale, window=16)
    torch.testing.assert_close(got.double(), want, **FP32_TOL)


@pytest.mark.parametrize("window", [None, 5])
def test_matches_sdpa_on_unpaged_kv(window):
    """A second, independent reference: torch's SDPA with an explicit boolean mask."""
    batch = make_batch(MIXED_BATCH, 4, 16, seed=window or 0)
    got = batch.attend(AttentionScoring(0.125, sliding_window=window))
    starts = batch.metadata.host_query_start_loc()
    for i, (k, v, context) in enumerate(zip(batch.keys, batch.values, batch.contexts)):
        q = batch.query[starts[i] : starts[i + 1]]
        query_pos = torch.arange(context, context + q.shape[0])[:, None]
        key_pos = torch.arange(k.shape[0])[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=0.125, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(got[starts[i] : starts[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_writes_into_out_and_leaves_padding_alone():
    # The last row is batch padding (no new tokens); two more token rows pad T itself.
    seqs = [(9, 1), (0, 5), (0, 0)]
    batch = make_batch(seqs, 2, 16)
    query = torch.cat([batch.query, torch.randn(2, *batch.query.shape[1:])])
    out = torch.full((query.shape[0], query.shape[1], 64), 123.0)
    cache = PagedKVCache(batch.key_cache, batch.value_cache)
    got = paged_attention(query, cache, batch.metadata, AttentionScoring(0.125), out=out)
    assert got is out
    torch.testing.assert_close(out[:6].double(), expected_output(batch, 0.125), **FP32_TOL)
    assert (out[6:] == 123.0).all()


def test_decode_only_and_prefill_only_batches():
    for seqs in ([(12, 1), (3, 1)], [(0, 7), (30, 9)]):
        batch = make_batch(seqs, 4, 16)
        got = batch.attend(AttentionScoring(0.125))
        torch.testing.assert_close(got.double(), expected_output(batch, 0.125), **FP32_TOL)


def test_bf16_within_one_rounding_of_the_exact_result():
    batch = make_batch(MIXED_BATCH, 4, 16, dtype=torch.bfloat16, seed=3)
    got = batch.attend(AttentionScoring(0.125, sliding_window=8, logits_soft_cap=2.0))
    assert got.dtype == torch.bfloat16
    # The same bf16 inputs in float64: the softmax runs in fp32, so the error is the final
    # rounding to bf16 (8 significant bits, relative 2^-9) plus fp32 noise; outputs are
    # averages of N(0, 1) values, so |out| < 4 and 4 * 2^-9 < 1e-2.
    want = expected_output(batch, 0.125, window=8, soft_cap=2.0)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=2**-8)


# Decodes, then prefills; contexts beyond GPT-OSS's window of 128 and beyond the small one.
SINK_BATCH = [(37, 1), (0, 1), (200, 1), (0, 13), (21, 6), (40, 17), (140, 30)]


def gpt_oss_attention(batch: Batch, sinks, scale, window) -> torch.Tensor:
    """HF GPT-OSS's eager attention per sequence, with the dense causal (and sliding
    window) mask of its new tokens over all its keys: an independent reference."""
    group = batch.query.shape[1] // KV_HEADS
    module = SimpleNamespace(num_key_value_groups=group, sinks=sinks, training=False)
    starts = batch.metadata.host_query_start_loc()
    outs = []
    for i, (k, v, context) in enumerate(zip(batch.keys, batch.values, batch.contexts)):
        q = batch.query[starts[i] : starts[i + 1]]
        query_pos = torch.arange(context, context + q.shape[0])[:, None]
        key_pos = torch.arange(k.shape[0])[None, :]
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= key_pos > query_pos - window
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        out, _ = eager_attention_forward(
            module,
            q.float().transpose(0, 1)[None],
            k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None],
            mask[None, None],
            scale,
        )
        outs.append(out[0])
    return torch.cat(outs)


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 8, 128])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 8])
def test_sinks_match_hf_gpt_oss(group, block_size, window, sink_dtype):
    batch = make_batch(SINK_BATCH, group, block_size, seed=group + block_size)
    # Sinks around the scores' range, one far above them (that head attends almost nowhere).
    sinks = (torch.randn(KV_HEADS * group) * 2).to(sink_dtype)
    sinks[-1] = 30.0
    scale = 1 / math.sqrt(64)
    got = batch.attend(AttentionScoring(scale, sliding_window=window, sinks=sinks))
    want = gpt_oss_attention(batch, sinks.float(), scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sinks_need_one_per_query_head():
    batch = make_batch(MIXED_BATCH, 2, 16)
    with pytest.raises(ValueError, match="one per query head"):
        batch.attend(AttentionScoring(0.125, sinks=torch.zeros(KV_HEADS)))


def test_attention_layer_uses_the_models_sinks():
    """The layer holds the model's parameter: values loaded into it after the layer was
    built reach the kernel (the native impl passes spec.sinks on)."""
    heads, head_dim, block_size = 8, 32, 4
    sinks = nn.Parameter(torch.zeros(heads), requires_grad=False)
    layer = Attention(heads, head_dim, 0.2, KV_HEADS, "layer", sliding_window=3, sinks=sinks)
    assert layer.spec.sinks is sinks
    with torch.no_grad():
        sinks.copy_(torch.randn(heads))  # what the loader does
    # A decode with 5 cached tokens and a 3-token prefill.
    metadata = AttentionMetadata.build([1, 3], [6, 3], [[0, 1], [2]], [5, 8, 9, 10])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, heads, head_dim, generator=gen)
    k = torch.randn(4, KV_HEADS, head_dim, generator=gen)
    v = torch.randn(4, KV_HEADS, head_dim, generator=gen)
    cache = torch.randn(3, block_size, KV_HEADS, head_dim, generator=gen)
    layer.impl.bind_kv_cache((cache.clone(), cache.clone()))
    with set_forward_context(metadata):
        got = layer(q.flatten(1), k.flatten(1), v.flatten(1))
    want = paged_attention_torch(
        q, layer.impl.key_cache, layer.impl.value_cache, metadata, 0.2, 3, None,
        torch.empty_like(q), sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(got, want.flatten(1), atol=0, rtol=0)
