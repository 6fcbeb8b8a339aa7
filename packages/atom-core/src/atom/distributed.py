"""The tensor-parallel group the layers shard over.

Layers only need a rank, a world size and two collectives. The native engine uses a
torch.distributed process group; a host plugin installs its own group (e.g. vLLM's
`get_tp_group()`), wrapped in an object with the same four members.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from atom.symmetric_all_reduce import SymmetricAllReduce


class TensorParallelGroup(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class SingleProcessGroup:
    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


class TorchDistributedGroup:
    """TP over a torch.distributed process group (gloo on CPU, NCCL on GPU); small
    messages between GPUs that reach each other's memory take `small_all_reduce`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        small_all_reduce: SymmetricAllReduce | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.small_all_reduce = small_all_reduce

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_all_reduce is not None and self.small_all_reduce.takes(x):
            return self.small_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_tp_group: TensorParallelGroup = SingleProcessGroup()


def get_tp_group() -> TensorParallelGroup:
    return _tp_group


def set_tp_group(group: TensorParallelGroup) -> None:
    global _tp_group
    _tp_group = group


def tp_rank() -> int:
    return _tp_group.rank


def tp_size() -> int:
    return _tp_group.world_size


def divide(numerator: int, denominator: int, what: str = "dimension") -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator
