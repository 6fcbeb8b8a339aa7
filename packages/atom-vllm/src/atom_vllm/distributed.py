"""vLLM's tensor-parallel group behind ATOM's `TensorParallelGroup` protocol, and vLLM's
expert parallelism as ATOM's.

ATOM's layers shard over `atom.distributed.get_tp_group()`; inside a vLLM worker that
must be vLLM's own TP group (its communicators, custom all-reduce, CUDA-graph capture
context), so the wrapper installs it before it builds the model. With vLLM's
`enable_expert_parallel` (and one data-parallel rank, so vLLM's EP group is the TP
group), ATOM's MoE layers split their experts whole over that group: attention stays
tensor parallel, every rank holds every token, and the experts' outputs meet in the
all-reduce a TP MoE layer ends with (`atom.expert_parallel.ReplicatedTokens`).
"""

from __future__ import annotations

from typing import Any

from atom.distributed import set_tp_group
from atom.expert_parallel import ExpertParallel, ReplicatedTokens, set_expert_parallel
from atom.hosts.group import CoordinatorTensorParallelGroup


def install_vllm_groups(vllm_config: Any) -> CoordinatorTensorParallelGroup:
    """Makes vLLM's TP group the one ATOM's layers use in this worker process, and its
    expert parallelism ATOM's (or none); returns the TP group."""
    from vllm.distributed.parallel_state import get_tp_group

    group = CoordinatorTensorParallelGroup(get_tp_group())
    set_tp_group(group)
    expert_parallel = vllm_config.parallel_config.enable_expert_parallel
    set_expert_parallel(ExpertParallel(group, ReplicatedTokens(group)) if expert_parallel else None)
    return group
