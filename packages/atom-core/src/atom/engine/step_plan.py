"""What a scheduled step feeds the model and which of its rows need logits."""

from __future__ import annotations

from atom.engine.sequence import Sequence
from atom.engine.step_arrays import FED_TOKEN, StepInput


class StepPlan:
    """A step's model inputs and which hidden rows need logits, in ascending order: the
    prompt positions of sequences that asked for prompt logprobs, and the last token of
    every sequence this step completes (it samples its next token)."""

    def __init__(self, seqs: list[Sequence], num_new_tokens: list[int], num_drafts: list[int]):
        self.inputs: list[StepInput] = []
        self.rows: list[int] = []
        self.prompt_logprobs: list[tuple[Sequence, int, int, int]] = []  # seq, first, last, row
        self.samples: list[Sequence] = []
        self.sample_rows: list[int] = []  # indexes into rows
        self.verified: list[tuple[Sequence, int]] = []  # sequences with drafts, how many
        self.verified_seqs: list[int] = []  # their indexes in the batch
        self.draft_rows: list[int] = []  # the token rows of their drafts (fed on the device)
        self.verified_rows: list[int] = []  # indexes into rows, all of theirs
        self.verified_starts: list[int] = []  # their first token row
        self.verified_num_rows: list[int] = []  # and their number of token rows
        self.token_starts: list[int] = []  # each sequence's first token row
        offset = 0
        for i, (seq, n, d) in enumerate(zip(seqs, num_new_tokens, num_drafts)):
            self.token_starts.append(offset)
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n - d] + [FED_TOKEN] * d
            self.inputs.append(StepInput(tokens, start, seq.block_tables, seq.state_slot))
            if d:
                self.verified.append((seq, d))
                self.verified_seqs.append(i)
                self.draft_rows += range(offset + n - d, offset + n)
                self.verified_starts.append(offset)
                self.verified_num_rows.append(n)
                self.verified_rows += range(len(self.rows), len(self.rows) + n)
                self.rows += range(offset, offset + n)
                offset += n
                continue
            if seq.prompt_logprobs is not None:
                # Positions whose next prompt token has no entry yet (a preempted sequence
                # recomputes positions it already recorded).
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    self.prompt_logprobs.append((seq, first, last, len(self.rows)))
                    self.rows += range(offset + first - start, offset + last - start)
            if start + n == len(seq.token_ids):
                self.sample_rows.append(len(self.rows))
                self.rows.append(offset + n - 1)
                self.samples.append(seq)
            offset += n

    def verified_state_rows(self) -> tuple[list[int], list[int], list[int]]:
        """The verified sequences' state slots, first token rows and row counts: what a
        hybrid model's DeltaNet layers keep of them (state_rollback.StateCheckpoints)."""
        slots = [seq.state_slot for seq, _ in self.verified]
        return slots, self.verified_starts, self.verified_num_rows
