"""vLLM's tensor-parallel group, seen through ATOM's `TensorParallelGroup` protocol.

ATOM's layers shard over `atom.distributed.get_tp_group()`; inside a vLLM worker that
must be vLLM's own TP group (its communicators, custom all-reduce, CUDA-graph capture
context), so the wrapper installs this adapter before it builds the model.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.distributed import set_tp_group


class VllmTensorParallelGroup:
    """rank / world_size / all_reduce / all_gather over a vLLM `GroupCoordinator`."""

    def __init__(self, coordinator: Any):
        self.coordinator = coordinator
        self.rank = coordinator.rank_in_group
        self.world_size = coordinator.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # vLLM's all-reduce is out of place: use the returned tensor.
        return self.coordinator.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.coordinator.all_gather(x, dim)

    def __repr__(self) -> str:
        return f"VllmTensorParallelGroup(rank={self.rank}, world_size={self.world_size})"


def install_vllm_tp_group() -> VllmTensorParallelGroup:
    """Makes vLLM's TP group the one ATOM's layers use in this worker process."""
    from vllm.distributed.parallel_state import get_tp_group

    group = VllmTensorParallelGroup(get_tp_group())
    set_tp_group(group)
    return group
