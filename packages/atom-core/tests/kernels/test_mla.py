"""MLA kernels against a dense, naive MLA computed from un-paged latents."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from atom.forward_context import AttentionMetadata
from atom.kernels import mla_attention, write_mla_cache
from atom.kernels.few_queries import MAX_DECODE_QUERIES, few_queries_as_decodes

HEADS, NOPE, ROPE, LATENT, VALUE = 4, 16, 8, 32, 12
SCALE = (NOPE + ROPE) ** -0.5


def naive_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, context: int) -> torch.Tensor:
    """Per-head keys/values expanded from all latents; query j sits at position context + j."""
    k_nope = torch.einsum("ml,hdl->hmd", kv_c, w_uk)
    value = torch.einsum("ml,hdl->hmd", kv_c, w_uv)
    key = torch.cat([k_nope, k_pe.unsqueeze(0).expand(HEADS, -1, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    scores = query @ key.transpose(1, 2) * SCALE
    positions = torch.arange(context, context + q_nope.shape[0])
    allowed = torch.arange(kv_c.shape[0])[None, :] <= positions[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(0, 1)


class Batch:
    """Random sequences (context, new tokens) laid out decode-first in a shuffled page pool."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        block_size: int,
        dtype=torch.float32,
        cache_dtype=None,
        kv_scale: float = 1.0,
    ):
        gen = torch.Generator().manual_seed(0)
        self.kv_scale = kv_scale

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.shapes = shapes
        self.w_uk, self.w_uv = rand(HEADS, NOPE, LATENT) * 0.2, rand(HEADS, VALUE, LATENT) * 0.2
        self.kv_c = [rand(c + n, LATENT) for c, n in shapes]
        self.k_pe = [rand(c + n, ROPE) for c, n in shapes]
        self.q_nope = [rand(n, HEADS, NOPE) for _, n in shapes]
        self.q_pe = [rand(n, HEADS, ROPE) for _, n in shapes]
        num_pages = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
        pages = list(range(num_pages))
        random.Random(0).shuffle(pages)
        self.tables = [[pages.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
        self.cache = torch.zeros(num_pages, block_size, LATENT + ROPE, dtype=cache_dtype or dtype)
        self.block_size = block_size

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def new_slots(self) -> list[int]:
        return [self.slot(i, p) for i, (c, n) in enumerate(self.shapes) for p in range(c, c + n)]

    def write_context(self) -> None:
        """The cached prefixes, as an earlier step would have written them."""
        for i, (c, _) in enumerate(self.shapes):
            slots = torch.tensor([self.slot(i, p) for p in range(c)], dtype=torch.int64)
            write_mla_cache(
                self.kv_c[i][:c], self.k_pe[i][:c], self.cache, slots, kv_scale=self.kv_scale
            )

    def metadata(self, slots: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=[n for _, n in self.shapes],
            seq_lens=[c + n for c, n in self.shapes],
            block_tables=self.tables,
            slot_mapping=slots,
        )

    def new(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t[c:] for t, (c, _) in zip(tensors, self.shapes)])

    def as_cached(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the cache returns them: through fp8 and back for an fp8 cache."""
        if self.cache.dtype != torch.float8_e4m3fn:
            return latents
        return (latents.float() / self.kv_scale).to(torch.float8_e4m3fn).float() * self.kv_scale

    def expected(self) -> torch.Tensor:
        parts = []
        for i, (context, _) in enumerate(self.shapes):
            inputs = (
                self.q_nope[i],
                self.q_pe[i],
                self.as_cached(self.kv_c[i]),
                self.as_cached(self.k_pe[i]),
                self.w_uk,
                self.w_uv,
            )
            parts.append(naive_mla(*(t.float() for t in inputs), context=context))
        return torch.cat(parts)

    def run(self, metadata: AttentionMetadata) -> torch.Tensor:
        self.write_context()
        write_mla_cache(
            self.new(self.kv_c), self.new(self.k_pe), self.cache, metadata.slot_mapping,
            kv_scale=self.kv_scale,
        )  # fmt: skip
        q_nope, q_pe = torch.cat(self.q_nope), torch.cat(self.q_pe)
        return mla_attention(
            q_nope, q_pe, self.cache, metadata, SCALE, self.w_uk, self.w_uv,
            kv_scale=self.kv_scale,
        ).float()  # fmt: skip


# (cached context, new tokens): decodes first, then prefills with and without a prefix.
MIXED = [(6, 1), (20, 1), (0, 1), (0, 9), (13, 5), (17, 23)]


@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_naive(block_size):
    batch = Batch(MIXED, block_size)
    metadata = batch.metadata(batch.new_slots())
    assert metadata.num_decodes == 3
    torch.testing.assert_close(batch.run(metadata), batch.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_only_and_prefill_only(block_size):
    for shapes in ([(5, 1), (31, 1)], [(0, 7), (11, 4)]):
        batch = Batch(shapes, block_size)
        out = batch.run(batch.metadata(batch.new_slots()))
        torch.testing.assert_close(out, batch.expected(), atol=1e-5, rtol=1e-5)


def test_absorbed_path_equals_up_projected_path_for_multi_token_queries():
    # Speculative decoding sends several tokens per sequence down the decode path.
    batch = Batch([(9, 3), (0, 4), (14, 2)], block_size=4)
    prefill = batch.metadata(batch.new_slots())
    absorbed = dataclasses.replace(
        prefill, num_decodes=prefill.num_seqs, num_decode_tokens=prefill.num_tokens
    )
    torch.testing.assert_close(batch.run(absorbed), batch.expected(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch.run(prefill), batch.expected(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_verify_step_takes_the_absorbed_path_and_matches_naive(block_size):
    """The same k + 1 new tokens for every sequence (a speculative verify step) run as
    decodes of k + 1 causal queries; more tokens, or uneven counts, stay prefills."""
    batch = Batch([(9, 4), (0, 4), (30, 4)], block_size)
    metadata = batch.metadata(batch.new_slots())
    assert metadata.num_decodes == 0
    as_decodes = few_queries_as_decodes(metadata)
    assert (as_decodes.num_decodes, as_decodes.num_decode_tokens) == (3, 12)
    torch.testing.assert_close(batch.run(metadata), batch.expected(), atol=1e-5, rtol=1e-5)
    for shapes in ([(9, MAX_DECODE_QUERIES + 1)] * 2, [(9, 3), (5, 4)]):
        prefills = Batch(shapes, block_size).metadata([0] * sum(n for _, n in shapes))
        assert few_queries_as_decodes(prefills).num_decodes == 0


def test_padding_slots_are_not_written():
    batch = Batch([(0, 3)], block_size=4)
    before = batch.cache.clone()
    slots = torch.tensor([batch.slot(0, 0), -1, batch.slot(0, 2)])
    write_mla_cache(batch.kv_c[0], batch.k_pe[0], batch.cache, slots)
    rows = batch.cache.flatten(0, 1)
    assert torch.equal(rows[slots[0]], torch.cat([batch.kv_c[0][0], batch.k_pe[0][0]]))
    assert torch.equal(rows[slots[2]], torch.cat([batch.kv_c[0][2], batch.k_pe[0][2]]))
    assert int((rows != before.flatten(0, 1)).any(-1).sum()) == 2


def test_bf16_close_to_fp32_naive():
    batch = Batch(MIXED, block_size=16, dtype=torch.bfloat16)
    out = batch.run(batch.metadata(batch.new_slots()))
    # Inputs are bf16 and the absorbed q / latent output round to bf16 once each.
    torch.testing.assert_close(out, batch.expected(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_size", [1, 16])
def test_fp8_cache_matches_naive_over_the_dequantized_latents(block_size):
    """An fp8 latent cache holds rows / kv_scale: both paths equal naive MLA over the
    latents rounded through fp8 (and differ from the unrounded ones)."""
    batch = Batch(MIXED, block_size, cache_dtype=torch.float8_e4m3fn, kv_scale=0.25)
    got = batch.run(batch.metadata(batch.new_slots()))
    torch.testing.assert_close(got, batch.expected(), atol=1e-4, rtol=1e-4)
    assert batch.cache.abs().float().max() > 4  # the rows were divided by the scale
    exact = Batch(MIXED, block_size)
    assert (got - exact.expected()).abs().max() > 1e-3


def test_model_dtype_cache_ignores_the_scale():
    plain = Batch(MIXED, 16)
    scaled = Batch(MIXED, 16, kv_scale=0.25)
    want = plain.run(plain.metadata(plain.new_slots()))
    assert torch.equal(scaled.run(scaled.metadata(scaled.new_slots())), want)
