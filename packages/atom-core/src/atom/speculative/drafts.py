"""A step's drafted tokens, which stay on the device from the drafter to the verifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.engine.step_arrays import TokenFeed


@dataclass
class Drafts:
    """Sequence i's j-th draft is tokens[sources[i][j]] (tokens: None when nobody drafts).

    The host knows how many tokens each sequence drafts before the drafter runs, and that
    is all it needs to lay out the verify step: the tokens go from the drafter's argmax
    into the verify step's inputs and the verifier's comparisons without a wait for the
    GPU, and reach the host with the tokens the verifier emits.
    """

    tokens: torch.Tensor | None
    sources: list[list[int]]

    @classmethod
    def none(cls, num_seqs: int) -> Drafts:
        return cls(None, [[] for _ in range(num_seqs)])

    @property
    def counts(self) -> list[int]:
        return [len(own) for own in self.sources]

    def of(self, seqs: list[int]) -> Drafts:
        """The drafts of the given sequences, in that order."""
        return Drafts(self.tokens, [self.sources[i] for i in seqs])

    def feed(self, rows: list[int]) -> TokenFeed:
        """The drafts, sequence by sequence, as the tokens of `rows` of a step's inputs."""
        return TokenFeed(self.tokens, rows, [source for own in self.sources for source in own])
