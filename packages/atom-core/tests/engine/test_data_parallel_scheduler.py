"""DataParallelScheduler: requests are pinned to the least loaded rank when they leave the
shared queue, and pages, prefix hits and preemptions stay within their rank."""

from __future__ import annotations

from atom.engine.block_manager import BlockManager
from atom.engine.data_parallel_scheduler import DataParallelScheduler
from atom.engine.sequence import Sequence, SequenceStatus
from atom.sampling_params import SamplingParams


def scheduler(num_blocks=8, max_num_seqs=2, ranks=2) -> DataParallelScheduler:
    return DataParallelScheduler(
        lambda: BlockManager(num_blocks, 4), ranks, max_num_seqs, max_num_batched_tokens=64
    )


def seq(length: int, first: int = 0) -> Sequence:
    return Sequence(list(range(first, first + length)), SamplingParams())


def test_requests_spread_over_ranks_and_wait_for_a_seat():
    s = scheduler()
    seqs = [seq(5) for _ in range(5)]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert batch.seqs_per_rank == [2, 2]
    assert [s.rank_of[x] for x in seqs[:4]] == [0, 1, 0, 1]
    assert list(s.unpinned) == [seqs[4]]  # every seat taken: not pinned yet
    s.finish(seqs[1])  # rank 1 frees a seat
    batch = s.schedule()
    assert s.rank_of[seqs[4]] == 1 and batch.seqs_per_rank == [2, 2]
    rank_of_batch = [s.rank_of[x] for x in batch.seqs]
    assert rank_of_batch == sorted(rank_of_batch)  # concatenated in rank order


def test_an_empty_rank_still_has_a_batch_of_nothing():
    s = scheduler()
    s.add(seq(3))
    batch = s.schedule()
    assert batch.seqs_per_rank == [1, 0]
    assert batch.of_rank(1) == ([], [])


def test_prefix_hits_and_preemption_stay_in_the_rank():
    s = scheduler(num_blocks=4, max_num_seqs=4)
    first = seq(9)
    s.add(first)
    s.schedule()
    first.num_computed_tokens = 9
    s.block_manager_of(first).register_full_blocks(first)
    s.finish(first)
    # Both ranks idle again: a tie goes to rank 0, whose block manager holds the prefix.
    again = seq(9)
    s.add(again)
    s.schedule()
    assert s.rank_of[again] == 0 and again.num_cached_tokens == 8
    assert s.block_managers[1].prefix_hits == 0


def test_abort_before_pinning():
    s = scheduler(max_num_seqs=1)
    seqs = [seq(3) for _ in range(3)]
    for x in seqs:
        s.add(x)
    s.schedule()
    s.finish(seqs[2])  # still in the shared queue
    assert seqs[2].status == SequenceStatus.FINISHED and not s.unpinned
    assert len(s.running) == 2 and s.num_preemptions == 0


def test_usage_is_the_fullest_ranks():
    """As BlockManager.usage, the fullest pool's: one rank full holds its sequences back
    whatever the other has free."""
    s = scheduler(num_blocks=8, max_num_seqs=4)
    s.add(seq(32))  # 8 pages of 4 tokens: all of rank 0's
    s.schedule()
    assert [bm.usage for bm in s.block_managers] == [1.0, 0.0]
    assert s.usage == 1.0
