"""vLLM's tensor-parallel group behind ATOM's `TensorParallelGroup` protocol, and vLLM's
expert parallelism as ATOM's.

ATOM's layers shard over `atom.distributed.get_tp_group()`; inside a vLLM worker that
must be vLLM's own TP group (its communicators, custom all-reduce, CUDA-graph capture
context), so the wrapper installs it before it builds the model. With vLLM's
`enable_expert_parallel` and one data-parallel rank (the bridge refuses more), vLLM's EP
group is the TP group, and ATOM's MoE layers split their experts whole over it.
"""

from __future__ import annotations

from typing import Any

from atom.hosts.group import CoordinatorTensorParallelGroup, install_host_groups


def install_vllm_groups(vllm_config: Any) -> CoordinatorTensorParallelGroup:
    """Makes vLLM's TP group (and expert parallelism) ATOM's in this worker process."""
    from vllm.distributed.parallel_state import get_tp_group

    expert_parallel = vllm_config.parallel_config.enable_expert_parallel
    return install_host_groups(get_tp_group(), expert_parallel)
