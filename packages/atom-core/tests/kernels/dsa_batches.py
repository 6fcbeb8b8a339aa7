"""Paged batches for the sparse-attention kernels (indexer, sparse MLA), shared by the
torch and Triton tests, and the naive math they are checked against.

Pages are scattered through a pool, and the pool's unused pages hold NaN, so a kernel
that reads a slot it was not given (even masked: 0 * NaN) returns NaN.
"""

from __future__ import annotations

import random

import torch

from atom.forward_context import AttentionMetadata
from atom.kernels.indexer import write_indexer_keys
from atom.kernels.mla import write_mla_cache

# (cached context, new tokens) per sequence, decodes first; page size.
BATCHES = {
    "mixed": ([(6, 1), (40, 1), (0, 1), (0, 9), (13, 5), (30, 23)], 4),
    "page 1": ([(20, 1), (9, 12)], 1),
    "page 16": ([(70, 1), (5, 40)], 16),
}
INDEX_HEADS, INDEX_DIM = 4, 32
HEADS, LATENT, ROPE, NOPE, VALUE = 4, 32, 16, 16, 24


class PagedBatch:
    """Random sequences laid out in a paged pool; `slot(seq, pos)` is a token's cache slot."""

    def __init__(self, shapes, block_size, device="cpu", dtype=torch.float32, seed=0):
        self.shapes, self.block_size, self.device, self.dtype = shapes, block_size, device, dtype
        pages = [-(-(c + n) // block_size) for c, n in shapes]
        pool = list(range(sum(pages) + 3))
        random.Random(seed).shuffle(pool)
        self.tables = [[pool.pop() for _ in range(p)] for p in pages]
        self.num_blocks = sum(pages) + 3
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape, std=1.0):
        return (torch.randn(*shape, generator=self.gen) * std).to(self.device, self.dtype)

    def nan_pool(self, width):
        return torch.full(
            (self.num_blocks, self.block_size, width), float("nan"), device=self.device,
            dtype=self.dtype,
        )  # fmt: skip

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def all_slots(self, seq: int) -> torch.Tensor:
        c, n = self.shapes[seq]
        return torch.tensor([self.slot(seq, p) for p in range(c + n)], device=self.device)

    def metadata(self) -> AttentionMetadata:
        slots = [self.slot(i, p) for i, (c, n) in enumerate(self.shapes) for p in range(c, c + n)]
        return AttentionMetadata.build(
            [n for _, n in self.shapes], [c + n for c, n in self.shapes], self.tables, slots,
            device=self.device,
        )  # fmt: skip

    def new_rows(self, per_seq: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t[c:] for t, (c, _) in zip(per_seq, self.shapes)])


def naive_index_scores(q, weights, keys) -> torch.Tensor:
    """score[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) for queries [n, Hi, Di] against
    one sequence's keys [S, Di] (no mask)."""
    return torch.stack(
        [
            sum(weights[t, h] * torch.relu(keys @ q[t, h]) for h in range(q.shape[1]))
            for t in range(q.shape[0])
        ]
    )


def naive_sparse_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, chosen) -> torch.Tensor:
    """Up-projected attention of one token [H, Dn] / [H, R] over the chosen positions of its
    sequence's latents kv_c [S, L] / k_pe [S, R] -> [H, Dv]."""
    out = []
    for h in range(q_nope.shape[0]):
        keys = torch.cat([kv_c[chosen] @ w_uk[h].T, k_pe[chosen]], dim=-1)
        probs = torch.softmax(keys @ torch.cat([q_nope[h], q_pe[h]]) * scale, dim=0)
        out.append(probs @ (kv_c[chosen] @ w_uv[h].T))
    return torch.stack(out)


def selection_case(batch: PagedBatch):
    """Per-sequence queries, weights and keys; the cache with the keys written."""
    q = [batch.randn(c + n, INDEX_HEADS, INDEX_DIM) for c, n in batch.shapes]
    w = [batch.randn(c + n, INDEX_HEADS).float() for c, n in batch.shapes]
    keys = [batch.randn(c + n, INDEX_DIM) for c, n in batch.shapes]
    cache = batch.nan_pool(INDEX_DIM)
    for i in range(len(batch.shapes)):
        write_indexer_keys(keys[i], cache, batch.all_slots(i))
    return q, w, keys, cache


def tie_case(new: int, device="cpu"):
    """A token at position 39 whose keys mostly score exactly 0 (every head's dot product is
    negative) and three keys score above 0, as the first of `new` query tokens (1: a
    decode, more: a verify step's row, which also spans the later positions). Returns the
    batch, its queries and weights, the cache, and the slots the token must select
    (topk 8): the three, then the five earliest of the zero-scored keys."""
    context, strong = 39, [3, 11, 17]
    batch = PagedBatch([(context, new)], 4, device=device)
    keys = -torch.ones(context + new, INDEX_DIM)
    keys[strong] = torch.tensor([3.0, 2.0, 1.0])[:, None]
    cache = batch.nan_pool(INDEX_DIM)
    write_indexer_keys(keys.to(device), cache, batch.all_slots(0))
    q = torch.ones(new, INDEX_HEADS, INDEX_DIM, device=device)
    w = torch.ones(new, INDEX_HEADS, device=device)
    expected = {batch.slot(0, p) for p in [*strong, 0, 1, 2, 4, 5]}
    return batch, q, w, cache, expected


def check_selection(batch, q, w, keys, slots, topk) -> None:
    """Each token's selection is a top-`topk` of its visible keys by naive score (compared
    by score, so ties at the boundary may pick either), -1 padded, each slot once."""
    row = 0
    for i, (c, n) in enumerate(batch.shapes):
        slot_to_pos = {batch.slot(i, p): p for p in range(c + n)}
        scores = naive_index_scores(q[i][c:].double(), w[i][c:].double(), keys[i].double())
        for t in range(n):
            visible = c + t + 1
            chosen = [s for s in slots[row].tolist() if s >= 0]
            assert len(chosen) == min(topk, visible) == len(set(chosen))
            assert slots[row, len(chosen) :].eq(-1).all()
            positions = [slot_to_pos[s] for s in chosen]
            assert max(positions) < visible
            best = scores[t, :visible].topk(len(chosen)).values
            got = scores[t, positions].sort(descending=True).values
            torch.testing.assert_close(got, best, atol=1e-9, rtol=0)
            row += 1


def sparse_case(
    batch: PagedBatch, topk: int, seed: int = 0, latent: int = LATENT, rope: int = ROPE
):
    """Latents in the cache, queries, and a random selection of visible positions per
    token (fewer than topk where fewer are visible, -1 padded, shuffled)."""
    rng = random.Random(seed)
    kv_c = [batch.randn(c + n, latent) for c, n in batch.shapes]
    k_pe = [batch.randn(c + n, rope) for c, n in batch.shapes]
    cache = batch.nan_pool(latent + rope)
    for i in range(len(batch.shapes)):
        write_mla_cache(kv_c[i], k_pe[i], cache, batch.all_slots(i))
    chosen, slots = [], []
    for i, (c, n) in enumerate(batch.shapes):
        for t in range(n):
            picks = rng.sample(range(c + t + 1), min(topk, c + t + 1))
            chosen.append((i, picks))
            row = [batch.slot(i, p) for p in picks] + [-1] * (topk - len(picks))
            rng.shuffle(row)
            slots.append(row)
    topk_slots = torch.tensor(slots, dtype=torch.int32, device=batch.device)
    return kv_c, k_pe, cache, chosen, topk_slots
