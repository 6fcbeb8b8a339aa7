"""The KV page pools: allocation, reference counts and prefix caching by block hash.

Pure Python. A full page is identified by a hash of its tokens chained with the hash of
the page before it (64-bit BLAKE2b from the standard library: no extra dependency on
the GPU machines), so equal prefixes map to equal pages. Freed pages keep their hash and
stay reusable until the allocator hands them out again, least recently freed first (that
is the eviction of unused cached pages).

A sequence has one block table per KV-cache group (kv_groups.py). Each group draws its
pages from one pool of one page shape (`PagePool`; page ids count from 0 in each pool):
most models have one pool, DeepSeek-V4 one for its per-token rows and one for its
compressed entries. A sliding-window group frees the pages its window has passed as the
sequence advances; their table entries stay as placeholders (FREED_PAGE) that the
attention kernels never read, so a token's page is still table[position // block_size].
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from atom.engine.kv_groups import pages_held
from atom.engine.sequence import Sequence

# Stands in a window group's table for a page it freed. A real page id, so that a stray
# read would stay in bounds; the kernels skip it (tests/kernels check with NaN pages).
FREED_PAGE = 0


class PagePool:
    """Pages of one shape: reference counts, the free list (least recently freed first)
    and the prefix each unused page still holds."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # A cached page's (group, hash): its content is that group's layers' K/V.
        self.cached_as: list[tuple[int, int] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.peak_in_use = 0

    @property
    def in_use(self) -> int:
        return self.num_blocks - len(self.free)


def block_hash(token_ids: list[int], parent: int | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(
        self,
        num_blocks: int | list[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: list[int | None] | None = None,
        pool_of: list[int] | None = None,
    ):
        """num_blocks: the pages of each pool (an int: one pool); windows: one per KV-cache
        group, its sliding window or None (full attention), default one full-attention
        group; pool_of: each group's pool, default pool 0."""
        counts = [num_blocks] if isinstance(num_blocks, int) else list(num_blocks)
        self.pools = [PagePool(n) for n in counts]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows) if windows is not None else [None]
        if not self.windows or any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows={self.windows}: give each group a window >= 1 or None")
        self.pool_of = list(pool_of) if pool_of is not None else [0] * len(self.windows)
        if len(self.pool_of) != len(self.windows) or set(self.pool_of) != set(range(len(counts))):
            raise ValueError(
                f"pool_of={self.pool_of}: name a pool of {counts} for each of the "
                f"{len(self.windows)} groups, every pool used"
            )
        self.block_of_hash: list[dict[int, int]] = [{} for _ in self.windows]
        self.windowed = any(w is not None for w in self.windows)
        self.peak_blocks_in_use = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(pool.free) for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fullest pool's fraction of pages in use (pools' pages differ in size, and
        the fullest one holds sequences back)."""
        return max(pool.in_use / pool.num_blocks for pool in self.pools)

    def pool_windows(self, pool: int) -> list[int | None]:
        return [w for w, p in zip(self.windows, self.pool_of) if p == pool]

    def pages_held(self, num_tokens: int, chunk: int) -> list[int]:
        """The most pages of each pool a sequence of num_tokens holds at once (chunks of
        <= chunk)."""
        return [
            pages_held(self.pool_windows(pool), self.block_size, num_tokens, chunk)
            for pool in range(len(self.pools))
        ]

    def _skipped(self, window: int | None, num_computed: int) -> int:
        """Leading pages a window no longer reaches: the next token (position
        num_computed) sees no key below num_computed - window + 1."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages (over all pools) the sequence takes to hold num_computed +
        num_new_tokens tokens."""
        return sum(self._needed_per_pool(seq, num_new_tokens))

    def _needed_per_pool(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """The pages each pool's groups add to their tables, less those their windows
        give back first."""
        want = self._pages_for(seq, num_new_tokens)
        needed = [0] * len(self.pools)
        for group, window in enumerate(self.windows):
            p = self.pool_of[group]
            if not seq.block_tables:
                needed[p] += want
                continue
            table = seq.block_tables[group]
            needed[p] += max(0, want - len(table))
            if window is not None:
                passed = table[
                    seq.num_released_blocks[group] : self._skipped(window, seq.num_computed_tokens)
                ]
                # A page another sequence shares stays in use.
                needed[p] -= sum(self.pools[p].ref_counts[page] == 1 for page in passed)
        return needed

    def _pages_for(self, seq: Sequence, num_new_tokens: int) -> int:
        """The pages a table needs to hold num_computed + num_new_tokens tokens."""
        return -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)

    def _unchanged(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The tables already hold the new tokens and no window passes a page: most decode
        steps, which a large batch then schedules without counting pages."""
        return (
            not self.windowed
            and bool(seq.block_tables)
            and self._pages_for(seq, num_new_tokens) <= len(seq.block_tables[0])
        )

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self._unchanged(seq, num_new_tokens):
            return True
        needed = self._needed_per_pool(seq, num_new_tokens)
        return all(n <= len(pool.free) for n, pool in zip(needed, self.pools))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Frees the pages the windows have passed, then adds pages so every table holds
        num_computed + num_new_tokens tokens."""
        if self._unchanged(seq, num_new_tokens):
            return
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
            seq.num_released_blocks = [0] * len(self.windows)
        want = self._pages_for(seq, num_new_tokens)
        for group, window in enumerate(self.windows):
            if window is not None:
                self._release_passed(seq, group, window)
            table = seq.block_tables[group]
            while len(table) < want:
                table.append(self._take(group))
        for pool in self.pools:
            pool.peak_in_use = max(pool.peak_in_use, pool.in_use)
        self.peak_blocks_in_use = max(
            self.peak_blocks_in_use, sum(pool.in_use for pool in self.pools)
        )

    def _release_passed(self, seq: Sequence, group: int, window: int) -> None:
        skipped = self._skipped(window, seq.num_computed_tokens)
        released = seq.num_released_blocks[group]
        if skipped <= released:
            return
        # Hash them first, so they stay in the prefix cache (every token before
        # num_computed is known on the host when the scheduler runs).
        self.register_full_blocks(seq)
        table = seq.block_tables[group]
        for index in range(released, skipped):
            self._release(group, table[index])
            table[index] = FREED_PAGE
        seq.num_released_blocks[group] = skipped

    def _take(self, group: int) -> int:
        """The pool's least recently freed page, which forgets the prefix it held."""
        pool = self.pools[self.pool_of[group]]
        block_id = next(iter(pool.free))
        del pool.free[block_id]
        cached_as = pool.cached_as[block_id]
        if cached_as is not None:
            owner, old_hash = cached_as
            if self.block_of_hash[owner].get(old_hash) == block_id:
                del self.block_of_hash[owner][old_hash]
        pool.cached_as[block_id] = None
        pool.ref_counts[block_id] = 1
        return block_id

    def _release(self, group: int, block_id: int) -> None:
        pool = self.pools[self.pool_of[group]]
        pool.ref_counts[block_id] -= 1
        if pool.ref_counts[block_id] == 0:
            pool.free[block_id] = None

    def match_prefix(self, seq: Sequence) -> None:
        """Attaches cached pages for the longest cached prefix of a new sequence.

        Every group must serve the hit: a full-attention group with every page of the
        prefix, a window group with the pages its window reaches from the hit point (the
        earlier ones may long be reused). The last prompt token is always recomputed so
        the step has a token to sample from.
        """
        # Prompt logprobs need every prompt position computed, so they bypass the cache.
        if not self.enable_prefix_caching or seq.block_tables or seq.prompt_logprobs is not None:
            return
        self.prefix_queries += seq.num_tokens
        hashes: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.windows]
        full_groups = [g for g, w in enumerate(self.windows) if w is None]
        parent = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = block_hash(tokens, parent)
            pages = [cache.get(h) for cache in self.block_of_hash]
            if any(pages[g] is None for g in full_groups):
                break
            hashes.append(h)
            for group, page in enumerate(pages):
                found[group].append(page)
            parent = h
        num_hit = len(hashes)
        while num_hit and not all(
            None not in found[g][self._skipped(w, num_hit * self.block_size) : num_hit]
            for g, w in enumerate(self.windows)
        ):
            num_hit -= 1
        if num_hit:
            seq.block_tables, seq.num_released_blocks = [], []
            for group, window in enumerate(self.windows):
                skipped = self._skipped(window, num_hit * self.block_size)
                live = [self._reuse(group, page) for page in found[group][skipped:num_hit]]
                seq.block_tables.append([FREED_PAGE] * skipped + live)
                seq.num_released_blocks.append(skipped)
        hits = num_hit * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hits
        seq.num_hashed_blocks = num_hit
        seq.last_block_hash = hashes[num_hit - 1] if num_hit else None
        self.prefix_hits += hits

    def cancel_match(self, seq: Sequence) -> None:
        """Undoes match_prefix for a sequence that stays waiting: its pages go back (a
        waiting sequence pins none) and its lookup counts once, when it is admitted."""
        if self.enable_prefix_caching and seq.prompt_logprobs is None:
            self.prefix_queries -= seq.num_tokens
            self.prefix_hits -= seq.num_cached_tokens
        self.free_sequence(seq)

    def _reuse(self, group: int, block_id: int) -> int:
        pool = self.pools[self.pool_of[group]]
        if pool.ref_counts[block_id] == 0:
            del pool.free[block_id]
        pool.ref_counts[block_id] += 1
        return block_id

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hashes pages the last steps filled, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for index in range(seq.num_hashed_blocks, full):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = block_hash(tokens, seq.last_block_hash)
            for group, table in enumerate(seq.block_tables):
                if h not in self.block_of_hash[group]:
                    self.block_of_hash[group][h] = table[index]
                    self.pools[self.pool_of[group]].cached_as[table[index]] = (group, h)
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_sequence(self, seq: Sequence) -> None:
        # Pages freed later in a sequence are its less shareable tail: free them first so
        # they are evicted before the common prefix.
        for group, (table, released) in enumerate(zip(seq.block_tables, seq.num_released_blocks)):
            for block_id in reversed(table[released:]):
                self._release(group, block_id)
        seq.block_tables, seq.num_released_blocks = [], []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
