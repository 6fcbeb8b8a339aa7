"""Expert parallelism: which experts a rank holds, and how tokens reach them.

With expert parallelism on, every MoE layer's experts are split whole over the EP group:
rank r of N holds experts [r * E/N, (r + 1) * E/N), each with its full intermediate size
(under tensor parallelism alone every rank holds a 1/N slice of every expert). The router
is replicated, so every rank routes its tokens over all experts; `ExpertPlacement` turns
the routed ids into this rank's local ids, and the fused-MoE kernels skip the slots routed
to other ranks' experts. The partial outputs are then summed back to the ranks that own
the tokens.

How tokens reach the experts depends on where they live, one `TokenExchange` each:

- `ReplicatedTokens`: the EP group is the tensor-parallel group. Attention is TP, so after
  it every rank holds every token: dispatch moves nothing and combine is one all-reduce
  (the same collective a TP MoE layer ends with).
- `GatheredTokens`: data-parallel attention. Every rank holds only its own batch's tokens:
  dispatch all-gathers them with their routing, combine reduce-scatters the experts'
  outputs so that each rank receives the sums of its own rows only.
- `AllToAllTokens` (atom.all_to_all_tokens): data-parallel attention, each token sent only
  to the ranks that hold one of its top-k experts and its partial outputs sent back.

The engine's `all2all_backend` picks one of the last two (vLLM's option of that name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from atom.distributed import TensorParallelGroup


class ExpertParallelError(ValueError):
    """An MoE layer's experts cannot be split over the expert-parallel group."""


@dataclass(frozen=True)
class ExpertPlacement:
    """The contiguous range of global expert ids one rank holds."""

    first: int
    count: int

    @classmethod
    def of_rank(cls, num_experts: int, rank: int, size: int, what: str) -> ExpertPlacement:
        if num_experts % size:
            raise ExpertParallelError(
                f"{what}={num_experts} is not divisible by the expert-parallel size {size}"
            )
        count = num_experts // size
        return cls(rank * count, count)

    def local_expert(self, expert_id: int) -> int | None:
        """The local index of a global expert, or None where another rank holds it."""
        local = expert_id - self.first
        return local if 0 <= local < self.count else None

    def owner_ranks(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The rank that holds each routed expert."""
        return topk_ids // self.count

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global routed ids -> local ids; other ranks' experts become `count`, which the
        kernels skip (one elementwise op, no host sync: capturable)."""
        local = topk_ids - self.first
        held = (local >= 0) & (local < self.count)
        return torch.where(held, local, self.count).to(topk_ids.dtype)


class TokenExchange(Protocol):
    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        placement: ExpertPlacement,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens and routing (global expert ids) -> the tokens this rank's
        experts must see, with theirs."""
        ...

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """This rank's experts' partial outputs for the dispatched tokens -> the full MoE
        output of this rank's own tokens."""
        ...


class ReplicatedTokens:
    """Every rank holds every token (attention is tensor parallel)."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group

    def dispatch(self, hidden, topk_weights, topk_ids, placement):
        return hidden, topk_weights, topk_ids

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(expert_out)


class GatheredTokens:
    """Every rank holds its own batch's tokens (data-parallel attention).

    The ranks' token counts differ, and they are known on the host before the step
    (the executor broadcasts them with the step's inputs), so `begin_step` takes them and
    no layer waits on a device-to-host copy to learn a size.
    """

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self.tokens_per_rank: list[int] | None = None
        self._uniform = False
        self._own_tokens = 0  # this rank's rows in the current layer, set by dispatch

    def begin_step(self, tokens_per_rank: list[int]) -> None:
        if len(tokens_per_rank) != self.group.world_size:
            raise ValueError(
                f"got token counts of {len(tokens_per_rank)} ranks for a data-parallel "
                f"group of {self.group.world_size}"
            )
        self.tokens_per_rank = list(tokens_per_rank)
        self._uniform = False

    def begin_uniform_steps(self) -> None:
        """Until the next begin_step, every rank runs as many tokens as this one: the
        capture of data-parallel decode graphs, where every rank captures the same padded
        sizes in the same order (atom.engine.data_parallel_graphs)."""
        self._uniform = True

    def _counts(self, local_tokens: int) -> list[int]:
        if self._uniform:
            return [local_tokens] * self.group.world_size
        counts = self.tokens_per_rank
        if counts is None:
            raise RuntimeError("data-parallel MoE step without begin_step(tokens_per_rank)")
        if counts[self.group.rank] != local_tokens:
            raise RuntimeError(
                f"rank {self.group.rank} was told it has {counts[self.group.rank]} tokens "
                f"this step but runs {local_tokens}"
            )
        return counts

    def _gather(self, x: torch.Tensor, counts: list[int], fill: int = 0) -> torch.Tensor:
        """All ranks' rows in rank order, each rank's padded with `fill` to the largest
        count: collectives move equal shapes, and the padded layout is the one combine's
        reduce-scatter splits into the ranks' shares."""
        padded = x.new_full((max(counts), *x.shape[1:]), fill)
        padded[: x.shape[0]] = x
        return self.group.all_gather(padded, dim=0)

    def dispatch(self, hidden, topk_weights, topk_ids, placement):
        counts = self._counts(hidden.shape[0])
        self._own_tokens = hidden.shape[0]
        # Padding rows route to expert -1, which no rank holds: the kernels skip them.
        return (
            self._gather(hidden, counts),
            self._gather(topk_weights, counts),
            self._gather(topk_ids, counts, fill=-1),
        )

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        # Each rank receives only its padded share of the sums: 1/N of an all-reduce's rows.
        own = self.group.reduce_scatter(expert_out)
        return own[: self._own_tokens]


@dataclass(frozen=True)
class ExpertParallel:
    """The group MoE layers split their experts over, and how tokens reach them."""

    group: TensorParallelGroup
    exchange: TokenExchange

    def placement(self, num_experts: int, what: str) -> ExpertPlacement:
        return ExpertPlacement.of_rank(num_experts, self.group.rank, self.group.world_size, what)


_expert_parallel: ExpertParallel | None = None


def get_expert_parallel() -> ExpertParallel | None:
    """None: MoE layers shard every expert's intermediate size over tensor parallelism."""
    return _expert_parallel


def set_expert_parallel(expert_parallel: ExpertParallel | None) -> None:
    global _expert_parallel
    _expert_parallel = expert_parallel
