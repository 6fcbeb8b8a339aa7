"""Sampling on each data-parallel rank: its own rows, token ids back to rank 0.

Under data-parallel attention every rank computes the logits of its own batch; shipping
them to rank 0 would move [rows, vocab] fp32 per step, so each rank samples and returns
only the results (token id, logprob, top logprobs). The sampler reads a sequence's
params, its seed and device generator, its tokens where a penalty needs them, and its
guide's allowed tokens; rank 0 keeps the `Sequence` objects, so it sends a `SampleRow`
with what the sampler will read, and the rank keeps the seeded sequences' generators
(their state advances each step) until rank 0 says the sequence is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from atom.engine.sampler import Sampler, SampleResult, uses_penalties
from atom.engine.sequence import Sequence
from atom.engine.step_arrays import StepInput
from atom.sampling_params import SamplingParams


def _guide_on_rank_0():
    raise RuntimeError("a guide lives on rank 0; a rank reads only its allowed tokens")


@dataclass
class SampleRow:
    """What a rank's sampler reads of one sequence (the sampler's view of a Sequence)."""

    seq_id: int
    params: SamplingParams  # its guide_factory replaced: the guide stays on rank 0
    seed: int | None
    prompt_ids: list[int]  # empty unless a penalty reads them
    output_ids: list[int]
    allowed: torch.Tensor | None  # [vocab] bool, the guide's mask for this step
    blocked: tuple[int, ...]  # token ids it may not pick (EOS under min_tokens)
    generator: torch.Generator | None = None  # the rank's, set before sampling
    guide: object | None = None

    @classmethod
    def of(cls, seq: Sequence, blocked, vocab: int) -> SampleRow:
        params = seq.params
        penalised = uses_penalties(params)
        allowed = None
        if seq.guide is not None:
            allowed = seq.guide.allowed_tokens(vocab).cpu()
            params = replace(params, guide_factory=_guide_on_rank_0)
        return cls(
            seq.seq_id,
            params,
            seq.seed,
            seq.prompt_ids if penalised else [],
            seq.output_ids if penalised else [],
            allowed,
            tuple(blocked),
        )


class _Mask:
    """Stands for a guide on the rank: its allowed tokens as computed on rank 0."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed

    def allowed_tokens(self, vocab: int) -> torch.Tensor:
        return self.allowed


@dataclass
class RankStep:
    """One DP rank's part of a step, as rank 0 broadcasts it to every rank."""

    inputs: list[StepInput]
    logit_rows: list[int]  # ascending token rows that need logits
    sample_rows: list[int]  # indexes into logit_rows, one per entry of `samples`
    samples: list[SampleRow]
    keep_logits: bool = False  # prompt logprobs: the logits rows go back to rank 0
    done_seq_ids: list[int] = field(default_factory=list)  # drop their generators

    @property
    def num_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.inputs)


@dataclass
class RankResult:
    samples: list[SampleResult]
    logits: torch.Tensor | None  # on the CPU, when the step asked for them


class RankSampler:
    """A rank's sampler, and the device generators of its seeded sequences."""

    def __init__(self, seed: int, compile: bool = False):
        self.sampler = Sampler(seed, compile=compile)
        self.generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor | None, step: RankStep) -> RankResult:
        for seq_id in step.done_seq_ids:
            self.generators.pop(seq_id, None)
        results = []
        if step.samples:
            rows = step.samples
            for row in rows:
                row.generator = self.generators.get(row.seq_id)
                row.guide = _Mask(row.allowed) if row.allowed is not None else None
            chosen = logits[torch.tensor(step.sample_rows, device=logits.device)]
            results = self.sampler.sample(chosen, rows, [row.blocked for row in rows])
            for row in rows:
                if row.generator is not None:
                    self.generators[row.seq_id] = row.generator
        kept = logits.cpu() if step.keep_logits and logits is not None else None
        return RankResult(results, kept)
