"""The TMA prefill kernel against the torch reference.

On CPU it runs in fp32 under Triton's interpreter (TRITON_INTERPRET=1), which executes
tensor descriptors; the `gpu` tests run bf16 through the real Hopper path.
"""

from __future__ import annotations

import pytest
import torch

# First: shares the device choice (and the skip without one) and the batch builder.
from test_triton_kernels import DEVICE, random_batch

from atom.kernels.paged_attention import paged_attention_torch
from atom.kernels.triton import paged_attention, paged_prefill_tma

CASES = [
    # decode contexts, prefills (cached context, new tokens), q heads, kv heads
    ([], [(0, 45), (19, 30), (64, 1)], 4, 4),  # no GQA, ragged, cached prefixes
    ([7, 90], [(0, 70), (5, 33)], 8, 2),  # decodes first, group 4
    ([40], [(33, 50)], 16, 2),  # group 8
    ([1, 2], [(3, 20)], 12, 4),  # group 3 (not a power of two)
]
# Small tiles keep the interpreter fast and give every sequence several tiles.
SMALL = {"rows": 32, "block_n": 32, "num_warps": 4, "num_stages": 2,
         "tiles_first": False, "split_pages": False}  # fmt: skip


def poison_unwritten_slots(cache, md):
    """NaN in the last page's slots past each sequence, which the kernel must not read."""
    block_size = cache.shape[1]
    for i, seq_len in enumerate(md.host_seq_lens()):
        page = md.block_table[i, (seq_len - 1) // block_size]
        cache[page, (seq_len - 1) % block_size + 1 :] = float("nan")


def check(case, head_dim, block_size, dtype, config, window=None, soft_cap=None, whole=False):
    decodes, prefills, heads, kv_heads = CASES[case]
    query, k_cache, v_cache, md = random_batch(
        decodes, prefills, block_size, heads, kv_heads, head_dim, dtype
    )
    for cache in (k_cache, v_cache):
        poison_unwritten_slots(cache, md)
    scale = head_dim**-0.5
    want = paged_attention_torch(
        query, k_cache, v_cache, md, scale, window, soft_cap, torch.zeros_like(query)
    )
    if whole:  # what the model runs: decode kernel plus whichever prefill kernel is picked
        got = paged_attention.paged_attention_triton(
            query, k_cache, v_cache, md, scale, window, soft_cap, torch.zeros_like(query)
        )
    else:
        got = paged_prefill_tma.prefill_attention_tma(
            query, k_cache, v_cache, md, scale, window, soft_cap, torch.zeros_like(query), config
        )
        got, want = got[md.num_decode_tokens :], want[md.num_decode_tokens :]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


# fp32 is the interpreter's dtype; the GPU path is for 16-bit caches only.
interpreter_only = pytest.mark.skipif(DEVICE == "cuda", reason="covered by the bf16 GPU tests")


@interpreter_only
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(
    "head_dim, block_size, block_n, split_pages",
    [
        (128, 16, 32, False),  # two page boxes stacked per tile
        (64, 16, 32, True),  # two page boxes, one dot each
        (64, 64, 32, False),  # half a page per tile
        (128, 64, 32, True),
        (64, 16, 16, False),  # a page per tile
    ],
)
def test_prefill_tma_fp32(case, head_dim, block_size, block_n, split_pages):
    config = dict(SMALL, block_n=block_n, split_pages=split_pages)
    check(case, head_dim, block_size, torch.float32, config)


@interpreter_only
@pytest.mark.parametrize("tiles_first, split_pages", [(False, True), (True, False)])
@pytest.mark.parametrize("window, soft_cap", [(37, None), (None, 30.0)])
def test_prefill_tma_fp32_window_soft_cap(tiles_first, split_pages, window, soft_cap):
    config = dict(SMALL, tiles_first=tiles_first, split_pages=split_pages)
    check(1, 64, 16, torch.float32, config, window, soft_cap)


GPU_CONFIGS = [
    paged_prefill_tma.PREFILL_TMA_CONFIG,
    dict(paged_prefill_tma.LONG_PREFILL_TMA_CONFIG, split_pages=True, tiles_first=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("config", range(len(GPU_CONFIGS)))
def test_prefill_tma_bf16(case, head_dim, block_size, config):
    check(case, head_dim, block_size, torch.bfloat16, GPU_CONFIGS[config])


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("window, soft_cap", [(None, None), (37, None), (None, 30.0)])
def test_paged_attention_picks_tma_bf16(case, window, soft_cap):
    query = torch.empty(1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    cache = torch.empty(4, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] >= 9 and torch.version.hip is None
    assert paged_prefill_tma.supports(query, cache, cache) == hopper
    check(case, 128, 16, torch.bfloat16, None, window, soft_cap, whole=True)
