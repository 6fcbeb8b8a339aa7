"""vLLM's tensor-parallel group behind ATOM's `TensorParallelGroup` protocol.

ATOM's layers shard over `atom.distributed.get_tp_group()`; inside a vLLM worker that
must be vLLM's own TP group (its communicators, custom all-reduce, CUDA-graph capture
context), so the wrapper installs it before it builds the model.
"""

from __future__ import annotations

from atom.distributed import set_tp_group
from atom.hosts.group import CoordinatorTensorParallelGroup


def install_vllm_tp_group() -> CoordinatorTensorParallelGroup:
    """Makes vLLM's TP group the one ATOM's layers use in this worker process."""
    from vllm.distributed.parallel_state import get_tp_group

    group = CoordinatorTensorParallelGroup(get_tp_group())
    set_tp_group(group)
    return group
