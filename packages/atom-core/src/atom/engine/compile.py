"""torch.compile in the native engine, confined to the sampler's `pick`.

`pick` makes several full passes over the [B, vocab] logits (argmax, logsumexp, gather,
packing); inductor fuses them, which halves its time at large batches (docs/performance.md,
"Sampler compile"; `benchmarks/compile.py` measures it). `draw` (the filtered sampling)
stays eager: inductor's Triton backend fails on its top-p cumsum.
The model is left alone: its layers are already fused Triton kernels around cuBLAS
matmuls, and their launchers read step metadata on the host, which dynamo would guard
on and recompile for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo

# Variants `pick` may need: with or without drawn rows and their index (None arguments are
# specialised on), each static at its first batch size and dynamic after. Dynamo's
# default of 8 would silently drop the rest to eager.
RECOMPILE_LIMIT = 32


def compiled(fn: Callable) -> Callable:
    """`fn` compiled as one graph; dynamo turns the batch dimension dynamic when it first
    changes (the form checked on the GPU)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, fullgraph=True)
