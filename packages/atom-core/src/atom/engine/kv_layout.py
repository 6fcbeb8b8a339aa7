"""The engine's KV memory as allocated: its page pools, how the budget was split between
them, and what a sequence holds of it, against the full layout (every layer keeping every
page). What the startup log, `atom serve` and `atom bench` report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atom.engine.kv_groups import KVCacheGroup, pages_held


@dataclass(frozen=True)
class KVPool:
    """One page pool (kv_groups.py): its pages, a page's bytes over its cache tensors, and
    those bytes by what the tensors hold (model_runner.kv_cache_page_parts)."""

    num_blocks: int
    page_bytes: int
    page_parts: dict[str, int] = field(default_factory=dict)


def pool_windows(groups: list[KVCacheGroup], pool: int) -> list[int | None]:
    return [g.sliding_window for g in groups if g.pool == pool]


def split_budget(
    budget: int,
    groups: list[KVCacheGroup],
    page_bytes: list[int],
    block_size: int,
    max_len: int,
    chunk: int,
) -> list[int]:
    """The pages of each pool that `budget` bytes buy.

    The pools' pages are not interchangeable, so the split is fixed at start. Each pool
    first keeps the pages that a prefill chunk of `chunk` tokens adds to a sequence's
    windows (pages_held with the chunk, less with one token: none for a full group; the
    step's token budget bounds all sequences' chunks together, so one chunk's worth
    serves them). The rest is split so that every pool holds as many decoding
    `max_len`-token sequences: pool k gets the pages one such sequence holds of it times
    its page bytes, over the sum of those. One pool gets everything. Shorter sequences
    hold as many window pages each and fewer full-history ones, so they fill a window
    pool first.
    """
    windows = [pool_windows(groups, pool) for pool in range(len(page_bytes))]
    decoding = [pages_held(w, block_size, max_len) for w in windows]
    chunk_pages = [pages_held(w, block_size, max_len, chunk) - d for w, d in zip(windows, decoding)]
    rest = budget - sum(p * b for p, b in zip(chunk_pages, page_bytes))
    sequence_bytes = sum(p * b for p, b in zip(decoding, page_bytes))
    return [max(0, rest * d // sequence_bytes + c) for d, c in zip(decoding, chunk_pages)]


@dataclass(frozen=True)
class KVCacheLayout:
    groups: list[KVCacheGroup]
    pools: list[KVPool]
    block_size: int
    full_layout_page_bytes: int  # one page if every layer kept every page (one pool)
    prefill_chunk: int = 1  # the chunk split_budget kept room for

    @property
    def windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    @property
    def pool_of(self) -> list[int]:
        return [g.pool for g in self.groups]

    def pages_held(self, context_len: int) -> list[int]:
        """The pages of each pool a sequence of `context_len` tokens holds while it decodes."""
        return [
            pages_held(pool_windows(self.groups, pool), self.block_size, context_len)
            for pool in range(len(self.pools))
        ]

    def bytes_per_token(self, context_len: int) -> float:
        """KV bytes per token of a sequence of `context_len` tokens while it decodes."""
        held = self.pages_held(context_len)
        return sum(p * pool.page_bytes for p, pool in zip(held, self.pools)) / context_len

    def full_layout_bytes_per_token(self, context_len: int) -> float:
        pages = -(-context_len // self.block_size)
        return pages * self.full_layout_page_bytes / context_len

    def report(self, context_len: int) -> dict:
        """The memory figures `atom bench` prints, for sequences of `context_len` tokens."""
        window = self.bytes_per_token(context_len)
        full = self.full_layout_bytes_per_token(context_len)
        return dict(
            kv_groups=", ".join(g.label for g in self.groups),
            context_len=context_len,
            kv_bytes_per_token=round(window, 1),
            kv_bytes_per_token_full_layout=round(full, 1),
            kv_saving=round(full / window, 3),
        )

    def _pool_text(self, pool: KVPool, blocks_of: str) -> str:
        text = f"{pool.num_blocks} blocks of {self.block_size} tokens{blocks_of}"
        if len(pool.page_parts) > 1:
            per_token = " + ".join(
                f"{size / self.block_size:.0f} B {label}" for label, size in pool.page_parts.items()
            )
            text = f"{text}, {pool.page_bytes / self.block_size:.0f} B per token ({per_token})"
        return text

    def summary(self, context_len: int, dtype: str) -> str:
        """One line for the startup log and `atom serve`'s summary; with window groups,
        how many `context_len`-token sequences fit, against the full layout (every layer
        keeps every page) in the same memory."""
        groups = ", ".join(g.label for g in self.groups)
        if len(self.pools) == 1:
            (pool,) = self.pools
            tokens = pool.num_blocks * self.block_size
            head = f"KV cache: {self._pool_text(pool, f' = {tokens} tokens ({dtype})')}"
            if self.windows == [None]:
                return f"{head}, {tokens / context_len:.1f} sequences of {context_len} tokens"
            plural = "s" if len(self.groups) > 1 else ""
            head = f"{head}, shared by {len(self.groups)} group{plural} ({groups})"
        else:
            parts = "; ".join(
                f"pool {i} ({', '.join(g.label for g in self.groups if g.pool == i)}): "
                f"{self._pool_text(pool, '')}"
                for i, pool in enumerate(self.pools)
            )
            head = (
                f"KV cache ({dtype}) in {len(self.pools)} pools by page shape, the memory "
                f"split so that each holds as many decoding {context_len}-token sequences, "
                f"the window pools a prefill chunk of {self.prefill_chunk} tokens more: {parts}"
            )
        held = self.pages_held(context_len)
        fits = min(pool.num_blocks // p for pool, p in zip(self.pools, held))
        total = sum(pool.num_blocks * pool.page_bytes for pool in self.pools)
        full_blocks = total // self.full_layout_page_bytes
        fits_full = full_blocks // -(-context_len // self.block_size)
        ratio = self.full_layout_bytes_per_token(context_len) / self.bytes_per_token(context_len)
        return (
            f"{head}: {fits} sequences of {context_len} tokens fit "
            f"({' + '.join(map(str, held))} blocks each), "
            f"{ratio:.2f}x the tokens of the full layout in the same memory ({fits_full} "
            f"sequences, {full_blocks} blocks of every layer)"
        )
