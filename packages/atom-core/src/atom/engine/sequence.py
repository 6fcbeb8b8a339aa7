"""A sequence: one completion's tokens, its KV pages and its progress through the engine."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto

import torch

from atom.engine.outputs import RequestMetrics
from atom.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str = "",
        completion_index: int = 0,
        metrics: RequestMetrics | None = None,
    ):
        """`metrics`: the record of the request this sequence is a completion of, shared by
        its sibling sequences (default: a record of its own, arriving now)."""
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.completion_index = completion_index
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        # One page list per KV-cache group (empty: no pages yet); the first
        # num_released_blocks[g] entries of group g are pages its window freed.
        self.block_tables: list[list[int]] = []
        self.num_released_blocks: list[int] = []
        self.state_slot: int | None = None  # a hybrid model's state pool row while scheduled
        # Speculative decoding: (first position, the target's hidden states there) that
        # the drafter has yet to read (atom.speculative.proposer).
        self.drafter_backlog: tuple[int, torch.Tensor] | None = None
        self.num_hashed_blocks = 0
        self.last_block_hash: int | None = None
        # Completions of one seeded request draw different but reproducible tokens.
        self.seed = params.seed + completion_index if params.seed is not None else None
        self.generator: torch.Generator | None = None  # made by the sampler on its device
        self.guide = params.guide_factory() if params.guide_factory is not None else None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = metrics if metrics is not None else RequestMetrics(time.monotonic())

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1
