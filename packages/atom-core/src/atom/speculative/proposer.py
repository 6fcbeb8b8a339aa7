"""Runs the drafter: catches its K/V up with what the target computed, then drafts.

The drafter's row at position p reads the target's hidden state at p and token p + 1, so
it trails the target by one token: the rows of a step become the drafter's input at the
next step, once their next tokens are known (`Sequence.drafter_backlog`). Each step:

1. catch-up: one forward over every scheduled sequence's backlog writes the drafter's
   K/V at those positions; a sequence that drafts takes its first draft from its last
   row;
2. k - 1 forwards of one row per drafting sequence, each reading the draft before it
   and the drafter's own hidden state, write K/V past the sequence's end (the target's
   verify step overwrites the target's layers there; the next catch-up the drafter's).
   The drafts stay on the device from one forward to the next (a `TokenFeed`), and on
   into the verify step (`drafts.Drafts`): the host lays the step out from their counts.

Drafts are the drafter's argmax: the verifier treats them as draws from a one-hot
distribution, which keeps the output exact (verifier.py).

A drafter (mtp.MtpDrafter, qwen3_next_mtp.Qwen3NextMtpDrafter, eagle3.Eagle3Drafter) offers `forward(input_ids, positions,
hidden, step) -> (output, state)`, `draft_tokens(output rows, step)` in the target's
vocabulary, `target_features(final hidden)`: what it reads of the target's step, and
`hidden_size`, the width of what it reads. Uniform batches (every sequence the same
number of rows) replay CUDA graphs (atom.engine.speculative_graphs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atom.engine.sequence import Sequence
from atom.engine.step_arrays import FED_TOKEN, StepInput, TokenFeed, to_device
from atom.speculative.drafts import Drafts

# One drafter forward over a StepInput list, the hidden states it reads, the draft step and
# the rows it drafts from (their tokens, their states for the next step); a TokenFeed gives
# input tokens that are still on the device.
DraftForward = Callable[
    [list[StepInput], torch.Tensor, int, list[int], TokenFeed | None],
    tuple[torch.Tensor, torch.Tensor],
]


class Proposer:
    def __init__(self, forward: DraftForward):
        """forward: runs on every rank (the executor's), so that a tensor-parallel drafter's
        collectives meet."""
        self._forward = forward

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> Drafts:
        """Drafts num_drafts[i] tokens for seqs[i] (0: catch-up only); every sequence with
        drafts must have a backlog, and pages for its drafts' positions."""
        order = sorted(
            (i for i, seq in enumerate(seqs) if seq.drafter_backlog is not None),
            key=lambda i: len(seqs[i].drafter_backlog[1]) > 1,  # one-row inputs first
        )
        drafts = Drafts.none(len(seqs))
        if not order:
            return drafts
        inputs, hidden, last_rows, num_rows = [], [], [], 0
        for i in order:
            seq = seqs[i]
            start, rows = seq.drafter_backlog
            seq.drafter_backlog = None
            inputs.append(
                StepInput(seq.token_ids[start + 1 : start + 1 + len(rows)], start, seq.block_tables)
            )
            hidden.append(rows)
            num_rows += len(rows)
            last_rows.append(num_rows - 1)
        drafting = [(i, row) for i, row in zip(order, last_rows) if num_drafts[i] > 0]
        tokens, state = self._forward(
            inputs, torch.cat(hidden), 0, [row for _, row in drafting], None
        )
        if not drafting:
            return drafts
        ids = [i for i, _ in drafting]
        drafted, offset = [], 0  # per draft position, the tokens of the sequences drafting it
        for step in range(max(num_drafts[i] for i in ids)):
            if step:
                keep = [j for j, i in enumerate(ids) if num_drafts[i] > step]
                if len(keep) < len(ids):
                    state = state[to_device(keep, state.device)]
                    ids = [ids[j] for j in keep]
                inputs = [
                    # Token q + step (fed from the step before), at position q + step - 1
                    # (q: the last known token's).
                    StepInput([FED_TOKEN], len(seqs[i].token_ids) + step - 2, seqs[i].block_tables)
                    for i in ids
                ]
                feed = TokenFeed(tokens, list(range(len(ids))), keep)
                tokens, state = self._forward(inputs, state, step, list(range(len(ids))), feed)
            drafted.append(tokens)
            for j, i in enumerate(ids):
                drafts.sources[i].append(offset + j)
            offset += len(ids)
        drafts.tokens = torch.cat(drafted)
        return drafts
