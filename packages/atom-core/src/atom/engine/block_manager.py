"""The KV page pool: allocation, reference counts and prefix caching by block hash.

Pure Python. A full page is identified by a hash of its tokens chained with the hash of
the page before it (64-bit BLAKE2b from the standard library: no extra dependency on
the GPU machines), so equal prefixes map to equal pages. Freed pages keep their hash and
stay reusable until the allocator hands them out again, least recently freed first (that
is the eviction of unused cached pages).

A sequence has one block table per KV-cache group (kv_groups.py), all drawn from this
one pool. A sliding-window group frees the pages its window has passed as the sequence
advances; their table entries stay as placeholders (FREED_PAGE) that the attention kernels
never read, so a token's page is still table[position // block_size].
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


def block_hash(token_ids: list[int], parent: int | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: list[int | None] | None = None,
    ):
        """windows: one per KV-cache group, its sliding window or None (full attention);
        default one full-attention group."""
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows) if windows is not None else [None]
        if not self.windows or any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows={self.windows}: give each group a window >= 1 or None")
        self.ref_counts = [0] * num_blocks
        # A cached page's (group, hash): its content is that group's layers' K/V.
        self.cached_as: list[tuple[int, int] | None] = [None] * num_blocks
        self.block_of_hash: list[dict[int, int]] = [{} for _ in self.windows]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.peak_blocks_in_use = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def pages_held(self, num_tokens: int, chunk: int) -> int:
        """The most pages a sequence of num_tokens holds at once (chunks of <= chunk)."""
        return pages_held(self.windows, self.block_size, num_tokens, chunk)

    def _skipped(self, window: int | None, num_computed: int) -> int:
        """Leading pages a window no longer reaches: the next token (position
        num_computed) sees no key below num_computed - window + 1."""
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free pages the sequence takes to hold num_computed + num_new_tokens tokens:
        the pages its tables add, less those its windows give back first."""
        want = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        if not seq.block_tables:
            return want * len(self.windows)
        needed = 0
        for group, window in enumerate(self.windows):
            table = seq.block_tables[group]
            needed += max(0, want - len(table))
            if window is not None:
                passed = table[
                    seq.num_released_blocks[group] : self._skipped(window, seq.num_computed_tokens)
                ]
                # A page another sequence shares stays in use.
                needed -= sum(self.ref_counts[page] == 1 for page in passed)
        return needed

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Frees the pages the windows have passed, then adds pages so every table holds
        num_computed + num_new_tokens tokens."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
            seq.num_released_blocks = [0] * len(self.windows)
        want = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        for group, window in enumerate(self.windows):
            if window is not None:
                self._release_passed(seq, group, window)
            table = seq.block_tables[group]
            while len(table) < want:
                table.append(self._take(next(iter(self.free))))
        in_use = self.num_blocks - len(self.free)
        if in_use > self.peak_blocks_in_use:
            self.peak_blocks_in_use = in_use

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
            self._release(table[index])
            table[index] = FREED_PAGE
        seq.num_released_blocks[group] = skipped

    def _take(self, block_id: int) -> int:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
            cached_as = self.cached_as[block_id]
            if cached_as is not None:
                group, old_hash = cached_as
                if self.block_of_hash[group].get(old_hash) == block_id:
                    del self.block_of_hash[group][old_hash]
            self.cached_as[block_id] = None
        self.ref_counts[block_id] += 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None

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
                live = [self._reuse(page) for page in found[group][skipped:num_hit]]
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

    def _reuse(self, block_id: int) -> int:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1
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
                    self.cached_as[table[index]] = (group, h)
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_sequence(self, seq: Sequence) -> None:
        # Pages freed later in a sequence are its less shareable tail: free them first so
        # they are evicted before the common prefix.
        for table, released in zip(seq.block_tables, seq.num_released_blocks):
            for block_id in reversed(table[released:]):
                self._release(block_id)
        seq.block_tables, seq.num_released_blocks = [], []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
