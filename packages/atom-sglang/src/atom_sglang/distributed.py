"""SGLang's tensor-parallel group installed as the one ATOM's layers shard over, and its
expert parallelism as ATOM's.

With `--ep-size` equal to `--tp-size` (SGLang's MoE expert-parallel group is then its TP
group), ATOM's MoE layers split their experts whole over it; another EP size would need
tokens exchanged between groups, and is refused by name.
"""

from __future__ import annotations

from atom.hosts.group import CoordinatorTensorParallelGroup, install_host_groups


class UnsupportedSglangParallelism(ValueError):
    """A parallel layout ATOM's layers cannot run in SGLang."""


def install_sglang_groups() -> CoordinatorTensorParallelGroup:
    """Makes SGLang's TP group (and expert parallelism) ATOM's in this worker process."""
    from sglang.srt.distributed.parallel_state import (
        get_moe_expert_parallel_world_size,
        get_tp_group,
    )

    tp, ep_size = get_tp_group(), get_moe_expert_parallel_world_size()
    if ep_size not in (1, tp.world_size):
        raise UnsupportedSglangParallelism(
            f"ATOM's MoE layers in SGLang split experts over the tensor-parallel group only: "
            f"ep_size={ep_size} with tp_size={tp.world_size}; set --ep-size 1 or "
            f"{tp.world_size}"
        )
    return install_host_groups(tp, expert_parallel=ep_size > 1)
