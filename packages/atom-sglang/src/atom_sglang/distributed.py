"""SGLang's tensor-parallel group installed as the one ATOM's layers shard over."""

from __future__ import annotations

from atom.distributed import set_tp_group
from atom.hosts.group import CoordinatorTensorParallelGroup


def install_sglang_tp_group() -> CoordinatorTensorParallelGroup:
    """Makes SGLang's TP group (`sglang.srt.distributed.get_tp_group()`) ATOM's."""
    from sglang.srt.distributed import get_tp_group

    group = CoordinatorTensorParallelGroup(get_tp_group())
    set_tp_group(group)
    return group
