"""Scheduling for data-parallel attention: one scheduler and block manager per DP rank.

Each rank holds its own KV cache, so a sequence's pages only make sense on one rank: a
request is pinned to a rank when it leaves the shared queue, and from then on its pages,
prefix-cache hits and preemptions stay within that rank's block manager. The `Scheduler`
and `BlockManager` classes are the single-rank ones, only instantiated per rank; this
class decides the pinning and merges the ranks' batches into one step.

Pinning: the rank with the fewest sequences (running and pinned-waiting), then the most
free pages. A sequence stays in the shared queue while every rank's seats (max_num_seqs,
which like max_num_batched_tokens is a per-rank limit) are taken, or while no rank has the
free pages its first chunk needs beyond what that rank's pinned-waiting sequences need:
pinning it to a full rank would leave it waiting there while another rank frees room.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from atom.engine.block_manager import BlockManager
from atom.engine.scheduler import ScheduledBatch, Scheduler
from atom.engine.sequence import Sequence, SequenceStatus


@dataclass
class DataParallelBatch(ScheduledBatch):
    """The ranks' batches, concatenated in rank order (each rank's decodes first)."""

    seqs_per_rank: list[int]

    def of_rank(self, rank: int) -> tuple[list[Sequence], list[int]]:
        """(sequences, new tokens of each) of one rank's batch."""
        start = sum(self.seqs_per_rank[:rank])
        end = start + self.seqs_per_rank[rank]
        return self.seqs[start:end], self.num_new_tokens[start:end]


class DataParallelScheduler:
    def __init__(self, make_block_manager: Callable[[], BlockManager], num_ranks: int,
                 max_num_seqs: int, max_num_batched_tokens: int,
                 make_state_slots: Callable[[], object] | None = None):  # fmt: skip
        self.block_managers = [make_block_manager() for _ in range(num_ranks)]
        self.schedulers = [
            Scheduler(
                bm,
                max_num_seqs,
                max_num_batched_tokens,
                make_state_slots() if make_state_slots is not None else None,
            )
            for bm in self.block_managers
        ]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.unpinned: deque[Sequence] = deque()
        self.rank_of: dict[Sequence, int] = {}

    # What the engine reads (Scheduler's interface) ------------------------------------

    @property
    def running(self) -> list[Sequence]:
        return [seq for s in self.schedulers for seq in s.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [*self.unpinned, *(seq for s in self.schedulers for seq in s.waiting)]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    def add(self, seq: Sequence) -> None:
        self.unpinned.append(seq)

    def has_work(self) -> bool:
        return bool(self.unpinned) or any(s.has_work() for s in self.schedulers)

    def block_manager_of(self, seq: Sequence) -> BlockManager:
        return self.block_managers[self.rank_of[seq]]

    def finish(self, seq: Sequence) -> None:
        rank = self.rank_of.pop(seq, None)
        if rank is None:  # aborted before it was pinned
            self.unpinned.remove(seq)
            seq.status = SequenceStatus.FINISHED
            return
        self.schedulers[rank].finish(seq)

    # The step ---------------------------------------------------------------------------

    def schedule(self) -> DataParallelBatch:
        self._pin_waiting()
        batches = [s.schedule() for s in self.schedulers]
        return DataParallelBatch(
            [seq for b in batches for seq in b.seqs],
            [n for b in batches for n in b.num_new_tokens],
            [d for b in batches for d in b.num_drafts],
            [len(b.seqs) for b in batches],
        )

    def _pin_waiting(self) -> None:
        # Pages each rank has left once its pinned-waiting sequences' first chunks are in.
        spare = [
            bm.num_free_blocks - sum(self._first_chunk_pages(bm, seq) for seq in s.waiting)
            for s, bm in zip(self.schedulers, self.block_managers)
        ]
        while self.unpinned:
            seq = self.unpinned[0]
            ranks = [
                r
                for r, s in enumerate(self.schedulers)
                if len(s.running) + len(s.waiting) < self.max_num_seqs
                and (
                    spare[r] >= self._first_chunk_pages(self.block_managers[r], seq)
                    or not s.has_work()  # an idle rank takes it: it is all free pages
                )
            ]
            if not ranks:
                return
            rank = min(
                ranks,
                key=lambda r: (
                    len(self.schedulers[r].running) + len(self.schedulers[r].waiting),
                    -spare[r],
                ),
            )
            self.unpinned.popleft()
            spare[rank] -= self._first_chunk_pages(self.block_managers[rank], seq)
            self.rank_of[seq] = rank
            self.schedulers[rank].add(seq)

    def _first_chunk_pages(self, bm: BlockManager, seq: Sequence) -> int:
        # Prefix-cache hits are not counted: an estimate on the safe side.
        chunk = min(seq.num_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)
        return bm.blocks_needed(seq, chunk)

    # Stats over the ranks -----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(bm.num_blocks for bm in self.block_managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(bm.num_free_blocks for bm in self.block_managers)

    @property
    def usage(self) -> float:
        """The fullest rank's (BlockManager.usage): that rank holds its sequences back."""
        return max(bm.usage for bm in self.block_managers)

    @property
    def prefix_queries(self) -> int:
        return sum(bm.prefix_queries for bm in self.block_managers)

    @property
    def prefix_hits(self) -> int:
        return sum(bm.prefix_hits for bm in self.block_managers)
