"""A request's RequestMetrics: the scheduler stamps its first admission once; a preempted
sequence that resumes, or a sibling admitted later, leaves the stamp as it was."""

from __future__ import annotations

from atom.engine.block_manager import BlockManager
from atom.engine.outputs import RequestMetrics
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence, SequenceStatus
from atom.sampling_params import SamplingParams


def run_step(scheduler: Scheduler) -> list[Sequence]:
    """Schedules a step and does what the engine does after it: the tokens are computed
    and each sequence gains a sampled token."""
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        seq.token_ids.append(0)
    return batch.seqs


def test_first_admission_is_stamped_once():
    # Two blocks of 4 tokens: two 4-token prompts fit, until each needs a second block.
    scheduler = Scheduler(BlockManager(2, 4), max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8)
    first = Sequence([1, 2, 3, 4], params)
    siblings = RequestMetrics(arrival_time=0.0)
    second, third = (Sequence([5, 6, 7, 8], params, metrics=siblings) for _ in range(2))
    for seq in (first, second, third):
        scheduler.add(seq)
    assert run_step(scheduler) == [first, second]  # no block is left for the third
    stamped = siblings.first_scheduled_time
    assert stamped is not None and first.metrics.first_scheduled_time is not None
    run_step(scheduler)  # the first needs a second block: the second is preempted
    assert second.status == SequenceStatus.WAITING
    scheduler.finish(first)
    assert run_step(scheduler) == [second]  # the preempted one resumes
    scheduler.finish(second)
    assert run_step(scheduler) == [third]  # the sibling, admitted last
    assert siblings.first_scheduled_time == stamped
