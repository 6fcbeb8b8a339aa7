"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences (decodes and unfinished chunked prefills) go first, then waiting ones,
under a token budget (`max_num_batched_tokens`, which chunks long prefills) and a cap on
concurrent sequences. When pages run out, the most recently admitted sequence is
preempted (its pages freed, recomputed later) and resumes before any new request.
Sliding-window layers give back the pages their window has passed as each sequence is
scheduled (block_manager.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from atom.engine.block_manager import BlockManager
from atom.engine.sequence import Sequence, SequenceStatus
from atom.engine.state_cache import StateSlots


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # drafts included
    num_drafts: list[int]  # speculative tokens among them, verified this step


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_slots: StateSlots | None = None,
        num_drafts: Callable[[Sequence], int] | None = None,
    ):
        """state_slots: a hybrid model's state pool rows, one per running sequence.
        num_drafts: how many speculative tokens a decoding sequence may verify in a step;
        they count against the token budget and get pages like any other token."""
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.num_drafts = num_drafts
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # admission order; O(1) removal
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int, int]] = []
        preempted = self.num_preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted while making room for an earlier sequence
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts = 0
            if n == 1 and self.num_drafts is not None:
                drafts = min(self.num_drafts(seq), budget - 1)
            if not self._make_room(seq, n + drafts):
                continue
            # Adds pages (most decode steps need none) and frees those the windows passed.
            self.block_manager.allocate(seq, n + drafts)
            chosen.append((seq, n + drafts, drafts))
            budget -= n + drafts
        # After a preemption the pool is full: admitting now would only preempt again.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and self.num_preemptions == preempted
        ):
            seq = self.waiting[0]
            self.block_manager.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, n):
                # Waiting sequences must not pin cached pages: with several of them
                # (preempted ones return to the front) nothing could run again.
                self.block_manager.cancel_match(seq)
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, n)
            # The request's first admission counts, not its siblings' or a resumption's.
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.take()
            self.running[seq] = None
            chosen.append((seq, n, 0))
            budget -= n
        # Rows with one new token first, as the attention schema requires (stable sort).
        chosen.sort(key=lambda item: item[1] > 1)
        return ScheduledBatch(*map(list, zip(*chosen))) if chosen else ScheduledBatch([], [], [])

    def _make_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Preempts later sequences until `seq` fits; False if `seq` itself was preempted."""
        while not self.block_manager.can_allocate(seq, num_new_tokens):
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq]
        self.block_manager.free_sequence(seq)
        self._release_state(seq)  # the recompute starts from zeros
        seq.drafter_backlog = None  # and gives the drafter its rows again
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            del self.running[seq]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_sequence(seq)
        self._release_state(seq)
        seq.drafter_backlog = None

    def _release_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.state_slots.release(seq.state_slot)
            seq.state_slot = None
