"""Whether a model can be captured in a CUDA graph, asked by every host before it captures.

A module whose forward waits on the host (a torch reference op that reads sequence lengths
or expert counts with `.item()` or data-dependent shapes) declares `cuda_graph_safe =
False`, usually as a property that asks the kernel policy (`atom.kernels.policy.
is_capturable`) about the ops it dispatches to on its device; one whose path depends on
the tokens per sequence (MLA: absorbed decode for one, up-projected prefill for more)
offers `cuda_graph_safe_for(query_tokens)` instead. The native engine
(`atom.engine.cuda_graphs`), atom-vllm and atom-sglang all capture through this one check.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.kernels.policy import selected_backend


def graph_blockers(model: nn.Module, device: torch.device, query_tokens: int = 1) -> list[str]:
    """Parts of the model that cannot be captured in a step of `query_tokens` new tokens
    per sequence (1: a decode; k + 1: a speculative verify step): torch reference ops that
    read sequence lengths or expert counts on the host (modules declare
    `cuda_graph_safe = False`, or `cuda_graph_safe_for(query_tokens)` False)."""
    blockers = {type(m).__name__ for m in model.modules() if not _capturable(m, query_tokens)}
    if selected_backend("paged_attention", device) == "torch":
        blockers.add("torch paged attention")
    return sorted(blockers)


def _capturable(module: nn.Module, query_tokens: int) -> bool:
    per_shape = getattr(module, "cuda_graph_safe_for", None)
    if per_shape is not None:
        return per_shape(query_tokens)
    return getattr(module, "cuda_graph_safe", True)
