"""The Triton prefill kernel against the torch reference of paged attention.

Keys come from the pages (cached prefix; every key without dense K/V) and from the
step's dense key/value (new tokens), so each case runs with and without them, over
page sizes that hold several pages per key block, several blocks per page, and neither.
On CPU it runs fp32 under Triton's interpreter (TRITON_INTERPRET=1; skipped otherwise),
with small tiles so that sequences span several tiles and blocks, and TMA forced on for
the descriptor path; the `gpu` cases run bf16 with the configs the dispatch picks.
"""

from __future__ import annotations

import random

import pytest
import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.paged_attention import gather_pages, paged_attention_torch
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import paged_attention, prefill_attention  # noqa: E402

SMALL = {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 2, "tma": False}
SMALL_TMA = dict(SMALL, tma=True)
HOST_PADDING = 3  # rows past the batch's tokens in key/value, as a host's padded batch


def make_batch(decodes, prefills, page_size, heads, kv_heads, head_dim, v_dim, dtype, seed=0):
    """Decodes (context lengths) first, then prefills (context, new tokens), pages scattered.

    Cache slots no sequence owns hold NaN (the kernel must not read them); key/value are
    every new token's K/V (the pages' contents at its position) plus NaN padding rows.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * len(decodes) + [n for _, n in prefills]
    seq_lens = [c + 1 for c in decodes] + [c + n for c, n in prefills]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    pool = list(range(sum(pages_needed) + 4))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in pages_needed]
    num_pages = max(max(t) for t in tables) + 1
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_pages, page_size, kv_heads, v_dim), float("nan"))
    slots = []
    for table, q, s in zip(tables, query_lens, seq_lens):
        owned = [table[p // page_size] * page_size + p % page_size for p in range(s)]
        k_cache.view(-1, kv_heads, head_dim)[owned] = torch.randn(
            s, kv_heads, head_dim, generator=gen
        )
        v_cache.view(-1, kv_heads, v_dim)[owned] = torch.randn(s, kv_heads, v_dim, generator=gen)
        slots += owned[s - q :]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, slots, device=DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)
    new_k, new_v = [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        new_k.append(gather_pages(k_cache, md.block_table[i], s)[s - q :])
        new_v.append(gather_pages(v_cache, md.block_table[i], s)[s - q :])
    pad = torch.full((HOST_PADDING, kv_heads, 1), float("nan"), device=DEVICE, dtype=dtype)
    key = torch.cat([*new_k, pad.expand(-1, -1, head_dim)])
    value = torch.cat([*new_v, pad.expand(-1, -1, v_dim)])
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(DEVICE, dtype)
    return query, k_cache, v_cache, md, key, value


def make_sinks(heads, dtype, seed=0):
    """Attention-sink logits around the scores' range, the last far above them (that head
    gives almost all its attention to the sink)."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[-1] = 30.0
    return sinks.to(DEVICE, dtype)


def check(
    case, dense, config, window=None, soft_cap=None, dtype=torch.float32, whole=False,
    sinks=False,
):  # fmt: skip
    decodes, prefills, page_size, heads, kv_heads, head_dim, v_dim = case
    query, k_cache, v_cache, md, key, value = make_batch(
        decodes, prefills, page_size, heads, kv_heads, head_dim, v_dim, dtype
    )
    kv = (key, value) if dense else (None, None)
    sink_logits = make_sinks(heads, dtype) if sinks else None
    scale = head_dim**-0.5
    out_shape = (query.shape[0], heads, v_dim)
    want = paged_attention_torch(
        query, k_cache, v_cache, md, scale, window, soft_cap, query.new_zeros(out_shape),
        sinks=sink_logits,
    )  # fmt: skip
    got = query.new_zeros(out_shape)
    if whole:  # what the models run: the decode kernel and the picked prefill config
        paged_attention.paged_attention_triton(
            query, k_cache, v_cache, md, scale, window, soft_cap, got, *kv, sinks=sink_logits
        )
    else:
        prefill_attention.prefill_attention(
            query, k_cache, v_cache, md, scale, window, soft_cap, got, *kv, sinks=sink_logits,
            config=config,
        )  # fmt: skip
        got, want = got[md.num_decode_tokens :], want[md.num_decode_tokens :]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


CASES = {
    # decode contexts, prefills (cached context, new tokens), page size, q/kv heads, dims
    "fresh+prefixed p16": ([5], [(0, 45), (19, 70), (64, 1)], 16, 4, 2, 64, 64),
    "page 1 (SGLang)": ([], [(0, 40), (23, 33)], 1, 4, 1, 64, 64),
    "page 32 > block": ([9, 40], [(0, 50), (37, 29)], 32, 6, 2, 64, 64),  # group 3
    "page 24 (nests neither way)": ([], [(0, 30), (50, 41)], 24, 4, 4, 64, 64),
    "group 8": ([], [(40, 37)], 16, 8, 1, 64, 64),
    "group 8, past window 21": ([], [(150, 40), (0, 70)], 16, 8, 1, 64, 64),
}
VARIANTS = {"causal": (None, None), "window": (21, None), "soft cap": (None, 5.0)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dense", [False, True], ids=["pages only", "dense new K/V"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_reference(case, dense, variant):
    check(CASES[case], dense, SMALL, *VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", ["fresh+prefixed p16", "page 1 (SGLang)"])
def test_tma_descriptors(case, variant):
    check(CASES[case], True, SMALL_TMA, *VARIANTS[variant])


@pytest.mark.parametrize(
    "head_dim, v_dim, tma",
    [(128, 128, True), (256, 256, True), (192, 128, False), (80, 80, False)],
)
def test_head_dims(head_dim, v_dim, tma):
    case = ([3], [(0, 33), (20, 17)], 16, 4, 2, head_dim, v_dim)
    check(case, True, SMALL_TMA if tma else SMALL, window=30)


def test_prefix_free_batch_skips_the_pages():
    """No prefill has context (known from the host copies): new keys only from key/value."""
    check(([4], [(0, 40), (0, 7)], 16, 4, 2, 64, 64), True, SMALL_TMA)


def test_prefix_unknown_without_host_copies():
    case = ([], [(0, 20), (35, 30)], 16, 4, 2, 64, 64)
    query, k_cache, v_cache, md, key, value = make_batch(*case, torch.float32)
    md.seq_lens_cpu = md.query_start_loc_cpu = None
    want = paged_attention_torch(
        query, k_cache, v_cache, md, 0.125, None, None, torch.zeros_like(query)
    )
    got = prefill_attention.prefill_attention(
        query,
        k_cache,
        v_cache,
        md,
        0.125,
        None,
        None,
        torch.zeros_like(query),
        key,
        value,
        config=SMALL,
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("case", ["fresh+prefixed p16", "page 32 > block"])
def test_whole_dispatch_with_picked_configs(case, dense):
    check(CASES[case], dense, None, window=13, whole=True)


GPU_CASES = {
    "long + prefixes": ([17, 900], [(0, 4100), (1000, 300), (33, 1500)], 16, 32, 8, 128, 128),
    "short": ([], [(0, 512)] * 6 + [(100, 200)], 16, 32, 8, 128, 128),
    "page 1": ([2], [(0, 700), (300, 129)], 1, 16, 2, 128, 128),
    "page 64": ([], [(70, 2000), (0, 1100)], 64, 16, 4, 128, 128),
    "dim 64": ([], [(0, 1000), (10, 90)], 16, 16, 4, 64, 64),
    "dim 256": ([5], [(0, 600), (77, 300)], 16, 8, 2, 256, 256),
    "MLA prefill dims": ([], [(0, 300), (50, 100)], 16, 16, 16, 192, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_bf16_on_gpu(case, dense):
    check(GPU_CASES[case], dense, None, dtype=torch.bfloat16, whole=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["window", "soft cap"])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("case", ["long + prefixes", "page 1"])
def test_bf16_window_and_soft_cap_on_gpu(case, dense, variant):
    check(GPU_CASES[case], dense, None, *VARIANTS[variant], dtype=torch.bfloat16, whole=True)


SINK_WINDOWS = {"no window": None, "window 21": 21}


@pytest.mark.parametrize("window", list(SINK_WINDOWS))
@pytest.mark.parametrize("dense", [False, True], ids=["pages only", "dense new K/V"])
@pytest.mark.parametrize("case", ["fresh+prefixed p16", "page 24 (nests neither way)",
                                  "group 8, past window 21"])  # fmt: skip
def test_sinks(case, dense, window):
    check(CASES[case], dense, SMALL, SINK_WINDOWS[window], sinks=True)


@pytest.mark.parametrize("window", list(SINK_WINDOWS))
def test_sinks_with_tma_descriptors(window):
    check(CASES["group 8, past window 21"], True, SMALL_TMA, SINK_WINDOWS[window], sinks=True)


# GPT-OSS: 64 q / 8 kv heads of 64 dims, sliding window 128 on every other layer. Contexts
# and prompt lengths around and past the window and off the page size; the decodes run
# the split-K kernel and its reduce.
GPT_OSS_CASE = ([3, 127, 128, 129, 1000], [(0, 1000), (200, 333), (130, 7), (0, 129)], 16, 64,
                8, 64, 64)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 128, 21], ids=["no window", "window 128", "window 21"])
@pytest.mark.parametrize("dense", [False, True], ids=["pages only", "dense new K/V"])
def test_gpt_oss_sinks_on_gpu(dense, window, dtype):
    check(GPT_OSS_CASE, dense, None, window, dtype=dtype, whole=True, sinks=True)
