"""The tensor-parallel group the layers shard over.

Layers only need a rank, a world size and three collectives. The native engine uses a
torch.distributed process group; a host plugin installs its own group (e.g. vLLM's
`get_tp_group()`), wrapped in an object with the same five members.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from atom.symmetric_all_reduce import SymmetricAllReduce

# torch 2.13 deprecates reduce_scatter_tensor for this name; 2.11 has only the old one.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TensorParallelGroup(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x, of which rank r gets the r-th of world_size equal
        chunks of rows (dim 0)."""
        ...


class SingleProcessGroup:
    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
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

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        # NCCL moves 1/N of the bytes of an all-reduce; gloo (CPU tests) runs it as an
        # all-reduce of which each rank keeps its chunk.
        out = x.new_empty(x.shape[0] // self.world_size, *x.shape[1:])
        _reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(
        self,
        x: torch.Tensor,
        send_rows: list[int] | None = None,
        receive_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Rows of x to each rank in turn, send_rows[r] of them to rank r; returns the rows
        received, receive_rows[r] of them from rank r, in rank order. Without the counts:
        equal shares. Only the native engine's data-parallel exchange needs it, so hosts'
        groups need not offer it."""
        rows = x.shape[0] if receive_rows is None else sum(receive_rows)
        out = x.new_empty(rows, *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive_rows, send_rows, group=self.group)
        return out


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
