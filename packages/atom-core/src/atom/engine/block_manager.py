"""The KV page pool: allocation, reference counts and prefix caching by block hash.

Pure Python. A full page is identified by a hash of its tokens chained with the hash of
the page before it (64-bit BLAKE2b from the standard library: no extra dependency on
the GPU machines), so equal prefixes map to equal pages. Freed pages keep their hash and
stay reusable until the allocator hands them out again, least recently freed first (that
is the eviction of unused cached pages).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from atom.engine.sequence import Sequence


def block_hash(token_ids: list[int], parent: int | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.block_of_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Adds pages so the sequence can hold num_computed + num_new_tokens tokens."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take(next(iter(self.free))))

    def _take(self, block_id: int) -> int:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
            old_hash = self.hash_of[block_id]
            if old_hash is not None and self.block_of_hash.get(old_hash) == block_id:
                del self.block_of_hash[old_hash]
            self.hash_of[block_id] = None
        self.ref_counts[block_id] += 1
        return block_id

    def match_prefix(self, seq: Sequence) -> None:
        """Attaches cached pages for the longest cached prefix of a new sequence.

        The last prompt token is always recomputed so the step has a token to sample from.
        """
        # Prompt logprobs need every prompt position computed, so they bypass the cache.
        if not self.enable_prefix_caching or seq.block_table or seq.prompt_logprobs is not None:
            return
        full_blocks = (seq.num_tokens - 1) // self.block_size
        self.prefix_queries += seq.num_tokens
        parent = None
        for index in range(full_blocks):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = block_hash(tokens, parent)
            block_id = self.block_of_hash.get(h)
            if block_id is None:
                break
            self._reuse(block_id)
            seq.block_table.append(block_id)
            parent = h
        hits = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hits
        seq.num_hashed_blocks, seq.last_block_hash = len(seq.block_table), parent
        self.prefix_hits += hits

    def _reuse(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hashes pages the last step filled, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        for index in range(seq.num_hashed_blocks, full):
            tokens = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            h = block_hash(tokens, seq.last_block_hash)
            block_id = seq.block_table[index]
            if h not in self.block_of_hash:
                self.block_of_hash[h] = block_id
                self.hash_of[block_id] = h
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_sequence(self, seq: Sequence) -> None:
        # Pages freed later in a sequence are its less shareable tail: free them first so
        # they are evicted before the common prefix.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
