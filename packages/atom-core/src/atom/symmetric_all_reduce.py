"""All-reduce of small messages over NVLink in one kernel, for decode steps.

NCCL's all-reduce costs tens of microseconds even for a few kilobytes: a decode step of a
tensor-parallel model runs two per layer on a few rows, and that latency, not bandwidth,
decides how much a second GPU buys (issue #32). Torch's symmetric memory maps every
rank's copy of one buffer into each GPU's address space; its one-shot all-reduce copies
this rank's input into the buffer, waits on the peers' signals, and sums the peers'
copies straight from their memory. Messages above `max_bytes` keep NCCL, whose ring
moves fewer bytes once there are more than two GPUs.

NVLink multicast (NVLS) is never used: `TORCH_SYMM_MEM_DISABLE_MULTICAST` is set before
the buffer is mapped, and only the one-shot (peer-read) kernel is called.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Largest message the one-shot kernel takes, by group size. Each GPU reads its N - 1
# peers' copies: on 2 GPUs that is the bytes a ring all-reduce moves too, so one-shot
# stays ahead into megabytes; on more, only while latency decides. To be set from
# benchmarks/all_reduce.py's first run on 2 and 4 H100s.
MAX_BYTES_BY_WORLD = {2: 8 << 20}
MAX_BYTES_OTHERWISE = 512 << 10


class SymmetricAllReduce:
    """One-shot all-reduce (sum) through a symmetric buffer of `max_bytes` per rank."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem

        self.max_bytes = max_bytes
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)

    @classmethod
    def create(
        cls, group: dist.ProcessGroup, device: torch.device, max_bytes: int | None = None
    ) -> SymmetricAllReduce | None:
        """The one-shot path where every GPU of the group reads its peers' memory; None
        (and one logged line) where it cannot run, so every all-reduce uses NCCL."""
        world = dist.get_world_size(group)
        if device.type != "cuda" or world < 2:
            return None
        if os.environ.get("ATOM_DISABLE_SYMM_MEM") == "1":
            logger.info("all-reduce: NCCL only (ATOM_DISABLE_SYMM_MEM=1)")
            return None
        ranks = [dist.get_global_rank(group, r) for r in range(world)]
        peers_reachable = all(
            torch.cuda.can_device_access_peer(device.index, peer)
            for peer in ranks
            if peer != device.index
        )
        if not peers_reachable:
            logger.info("all-reduce: NCCL only (the GPUs cannot read each other's memory)")
            return None
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if max_bytes is None:
            max_bytes = MAX_BYTES_BY_WORLD.get(world, MAX_BYTES_OTHERWISE)
        try:
            return cls(group, device, max_bytes)
        except (RuntimeError, ImportError) as error:
            logger.info("all-reduce: NCCL only (symmetric memory unavailable: %s)", error)
            return None

    def takes(self, x: torch.Tensor) -> bool:
        # The kernel moves 16 bytes a thread.
        return x.is_cuda and x.is_contiguous() and x.nbytes <= self.max_bytes and x.nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[: x.nbytes].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)
