"""torch.compile in the native engine, confined to the sampler's [B, vocab] math.

There a step runs a dozen elementwise ops and reductions over the logits (temperature,
filters, softmax, noise race, argmax, logsumexp), each a full pass over B x vocab floats;
inductor fuses them into a few kernels. The model is left alone: its layers are already
fused Triton kernels (norm with residual, rotary with the KV write, attention, SiLU-and-mul,
MoE) around cuBLAS matmuls, so there is no glue left to fuse, and their launchers read step
metadata on the host, which dynamo would guard on and recompile for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

# Variants a sampler function may need: one per combination of the filters in use (None
# arguments are specialised on) times batch 1 / any batch. Dynamo's default of 8 would
# silently drop the rest to eager.
RECOMPILE_LIMIT = 32


def compiled(fn: Callable) -> Callable:
    """`fn` compiled for any batch size; it must trace as one graph."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True, fullgraph=True)
