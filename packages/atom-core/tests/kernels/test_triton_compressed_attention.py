"""Triton DeepSeek-V4 compressed attention against its torch references: window
compression (atom.kernels.window_compression), the indexer's top-k over entries and the
attention (atom.kernels.compressed_attention).

Batches mix decodes with prefills that have cached context (chunked prefill, a prefix
hit), on scattered pages whose unused rows hold NaN; windows cross pages; CSA (rate 4,
overlap) and HCA (rate 16) rates on pages smaller, equal to and larger than a window.
Small shapes run on CPU under Triton's interpreter (TRITON_INTERPRET=1, fp32);
DeepSeek-V4 shapes and bf16 need a GPU.
"""

from __future__ import annotations

import pytest
import torch
from tests.kernels.dsa_batches import PagedBatch

from atom.kernels.compressed_attention import (
    compressed_attention_torch,
    compressed_entry_topk_torch,
    entries_per_page,
    entry_slots,
)
from atom.kernels.indexer import write_indexer_keys_torch
from atom.kernels.window_compression import compress_windows_torch
from atom.layers.kv_compressor import KVCompressor
from atom.layers.rotary import TrailingRotaryEmbedding
from atom.testing.triton_device import triton_test_device

pytest.importorskip("triton")

DEVICE = triton_test_device()

from atom.kernels.triton import compressed_attention, window_compression  # noqa: E402

GPU = pytest.mark.gpu

# (cached context, new tokens) per sequence, decodes first; page size.
BATCHES = {
    "pages of 4": ([(37, 1), (20, 1), (0, 9), (13, 22)], 4),
    "pages of 16": ([(70, 1), (5, 40)], 16),
}
CSA, HCA = (4, True), (16, False)  # (rate, overlap)
HEADS, HEAD_DIM, WINDOW, TOPK = 4, 32, 8, 3


class V4Batch(PagedBatch):
    """A paged batch with every token's row of a per-token cache and every closed entry of
    an entry cache written (NaN elsewhere)."""

    def token_cache(self, width: int) -> torch.Tensor:
        cache = self.nan_pool(width)
        for i, (c, n) in enumerate(self.shapes):
            write_indexer_keys_torch(self.randn(c + n, width), cache, self.all_slots(i))
        return cache

    def entry_cache(self, rate: int, width: int, std: float = 1.0) -> torch.Tensor:
        per_page = entries_per_page(rate, self.block_size)
        cache = torch.full((self.num_blocks, per_page, width), float("nan"), device=self.device,
                           dtype=self.dtype)  # fmt: skip
        for i, (c, n) in enumerate(self.shapes):
            table = torch.tensor(self.tables[i], device=self.device)
            entries = torch.arange((c + n) // rate, device=self.device)
            slots = entry_slots(table, entries, rate, self.block_size)
            cache[slots // per_page, slots % per_page] = self.randn(len(entries), width, std=std)
        return cache

    def padded_metadata(self):
        """The step with one more token than its sequences have (a host's padding)."""
        metadata = self.metadata()
        pad = torch.full((1,), -1, dtype=metadata.slot_mapping.dtype, device=self.device)
        metadata.slot_mapping = torch.cat([metadata.slot_mapping, pad])
        return metadata


def make_compressor(batch: V4Batch, rate: int, overlap: bool, head_dim: int) -> KVCompressor:
    """Its position bias in fp32 and its norm in the batch's dtype, as in a model."""
    rotary = TrailingRotaryEmbedding(head_dim // 4, {"rope_theta": 10000.0})
    compressor = KVCompressor(8, head_dim, rate, overlap, rotary, 1e-6).to(batch.device)
    compressor.ape.copy_(batch.randn(*compressor.ape.shape).float())
    compressor.norm.weight.data = batch.randn(head_dim) + 1
    return compressor


def check_window_compression(batch: V4Batch, rate: int, overlap: bool, head_dim: int, tol):
    compressor = make_compressor(batch, rate, overlap, head_dim)
    rows = batch.token_cache(compressor.row_width)
    metadata = batch.padded_metadata()
    expected = batch.entry_cache(rate, head_dim)
    got = expected.clone()
    with torch.no_grad():
        compress_windows_torch(compressor, rows, expected, metadata)
        window_compression.compress_windows_triton(compressor, rows, got, metadata)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol, equal_nan=True)


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("rate, overlap", [CSA, HCA], ids=["CSA", "HCA"])
def test_window_compression_matches_reference(name, rate, overlap):
    batch = V4Batch(*BATCHES[name], device=DEVICE)
    check_window_compression(batch, rate, overlap, HEAD_DIM, tol=1e-5)


@pytest.mark.parametrize("name", list(BATCHES))
def test_entry_topk_matches_reference(name):
    batch = V4Batch(*BATCHES[name], device=DEVICE)
    rate = CSA[0]
    cache = batch.entry_cache(rate, HEAD_DIM)
    metadata = batch.padded_metadata()
    tokens = metadata.num_tokens
    q, w = batch.randn(tokens, 4, HEAD_DIM), batch.randn(tokens, 4).float()
    expected = torch.empty(tokens, TOPK, dtype=torch.int32, device=DEVICE)
    got = torch.empty_like(expected)
    compressed_entry_topk_torch(q, w, cache, metadata, rate, batch.block_size, TOPK, expected)
    compressed_attention.compressed_entry_topk_triton(
        q, w, cache, metadata, rate, batch.block_size, TOPK, got
    )
    # Scores are distinct (random): the same entries, in any order.
    assert torch.equal(got.sort(dim=1).values, expected.sort(dim=1).values)
    assert got[-1].eq(-1).all() and got.eq(-1).any() and got.ge(0).any()


def chosen_entries(batch: V4Batch, rate: int, topk: int, seed: int = 0) -> torch.Tensor:
    """A random choice of each token's visible entries, -1 padded and shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for c, n in batch.shapes:
        for position in range(c, c + n):
            visible = (position + 1) // rate
            picks = torch.randperm(visible, generator=gen)[:topk].tolist()
            row = torch.tensor(picks + [-1] * (topk - len(picks)), dtype=torch.int32)
            rows.append(row[torch.randperm(topk, generator=gen)])
    rows.append(torch.full((topk,), -1, dtype=torch.int32))  # the padding token
    return torch.stack(rows).to(batch.device)


# Each layer kind's entries: (rate, top-k of the indexer or None: every closed entry).
KINDS = {"sliding": (0, None), "CSA": (CSA[0], TOPK), "HCA": (HCA[0], None)}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_matches_reference(name, kind):
    batch = V4Batch(*BATCHES[name], device=DEVICE)
    check_attention(batch, *KINDS[kind], HEADS, HEAD_DIM, WINDOW, tol=1e-4)


def check_attention(batch, rate, topk, heads, head_dim, window, tol):
    kv_cache = batch.token_cache(head_dim)
    metadata = batch.padded_metadata()
    tokens = metadata.num_tokens
    q = batch.randn(tokens, heads, head_dim, std=head_dim**-0.25)
    sinks = batch.randn(heads).float()
    entry_cache = batch.entry_cache(rate, head_dim) if rate else None
    chosen = chosen_entries(batch, rate, topk) if topk else None
    args = (q, kv_cache, entry_cache, metadata, window, rate, chosen, head_dim**-0.5, sinks)
    expected = compressed_attention_torch(*args, torch.zeros_like(q))
    got = compressed_attention.compressed_attention_triton(*args, torch.full_like(q, 7.0))
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    assert got[-1].eq(0).all()  # the padding token


# DeepSeek-V4: 64 heads of 512 (one K = V head), a window of 128, CSA rate 4 keeping 512
# entries (its indexer's keys 128 wide), HCA rate 128; pages of 64.
V4_KINDS = {"sliding": (0, None), "CSA": (4, 512), "HCA": (128, None)}
V4_BATCH = [(5000, 1)] * 4 + [(127, 1), (700, 300)]


@GPU
@pytest.mark.skipif(DEVICE != "cuda", reason="DeepSeek-V4 shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(V4_KINDS))
def test_v4_shape_attention(kind, dtype):
    batch = V4Batch(V4_BATCH, 64, device=DEVICE, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    check_attention(batch, *V4_KINDS[kind], 64, 512, 128, tol=tol)


@GPU
@pytest.mark.skipif(DEVICE != "cuda", reason="DeepSeek-V4 shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rate, overlap, head_dim", [(4, True, 512), (128, False, 512),
                                                     (4, True, 128)])  # fmt: skip
def test_v4_shape_window_compression(rate, overlap, head_dim, dtype):
    batch = V4Batch(V4_BATCH, 64, device=DEVICE, dtype=dtype)
    check_window_compression(
        batch, rate, overlap, head_dim, 1e-4 if dtype == torch.float32 else 3e-2
    )


@GPU
@pytest.mark.skipif(DEVICE != "cuda", reason="DeepSeek-V4 shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_shape_entry_topk_selects_what_the_reference_selects(dtype):
    batch = V4Batch(V4_BATCH, 64, device=DEVICE, dtype=dtype)
    cache = batch.entry_cache(4, 128)
    metadata = batch.padded_metadata()
    tokens = metadata.num_tokens
    q = batch.randn(tokens, 64, 128)
    w = batch.randn(tokens, 64).float() * 64**-0.5 * 128**-0.5
    expected = torch.empty(tokens, 512, dtype=torch.int32, device=DEVICE)
    got = torch.empty_like(expected)
    compressed_entry_topk_torch(q, w, cache, metadata, 4, 64, 512, expected)
    compressed_attention.compressed_entry_topk_triton(q, w, cache, metadata, 4, 64, 512, got)
    # Rounding differs between the two, so near-ties at the boundary may swap.
    for t in range(tokens):
        a, b = set(expected[t].tolist()), set(got[t].tolist())
        assert len(a & b) >= 0.99 * len(a)
