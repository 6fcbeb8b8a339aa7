"""A host's tensor-parallel group coordinator seen through ATOM's `TensorParallelGroup`.

vLLM and SGLang both hand their workers a `GroupCoordinator` (SGLang's is derived from
vLLM's) with `rank_in_group`, `world_size`, an out-of-place `all_reduce(x)` and
`all_gather(x, dim)`, and a reduce-scatter under a name of each host's. ATOM's layers must
shard over that very group (its communicators, custom all-reduce and CUDA-graph capture
context), so a plugin installs this adapter (`atom.distributed.set_tp_group`) before it
builds the model.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.distributed import set_tp_group
from atom.expert_parallel import ExpertParallel, ReplicatedTokens, set_expert_parallel


class CoordinatorTensorParallelGroup:
    """rank / world_size / all_reduce / all_gather / reduce_scatter over a host's group
    coordinator."""

    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size
        # vLLM: reduce_scatter(x, dim) -> the chunk. SGLang (0.5.21-0.5.23) names that one
        # reduce_scatter_along_dim; its reduce_scatter(output, input_list) is in place.
        self._reduce_scatter = getattr(
            coordinator, "reduce_scatter_along_dim", coordinator.reduce_scatter
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # The hosts' all-reduce is out of place: use the returned tensor.
        return self.coordinator.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.coordinator.all_gather(x, dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce_scatter(x, 0)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.coordinator).__name__}, "
            f"rank={self.rank}, world_size={self.world_size})"
        )


def install_host_groups(coordinator: Any, expert_parallel: bool) -> CoordinatorTensorParallelGroup:
    """A host's TP group as the one ATOM's layers shard over in this worker, and with
    `expert_parallel` the group ATOM's MoE layers split their experts over. Only where the
    host's expert-parallel group is its TP group: attention stays tensor parallel, every
    rank holds every token, and the experts' outputs meet in one all-reduce
    (`ReplicatedTokens`). Called before the model is built; clears what an earlier model
    of the process installed."""
    group = CoordinatorTensorParallelGroup(coordinator)
    set_tp_group(group)
    set_expert_parallel(ExpertParallel(group, ReplicatedTokens(group)) if expert_parallel else None)
    return group
