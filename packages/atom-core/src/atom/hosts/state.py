"""A host's per-request state slots as the schema's `state_slots` / `has_initial_state`.

Hybrid models (Gated DeltaNet layers) keep a conv and a recurrent state per request in
pools the host's state manager owns (vLLM's mamba cache blocks, SGLang's mamba pool).
Every host knows, per request, which pool row it gave the request and how many of its
tokens were computed before this step; that is all ATOM's ops need: the row, and
whether it already holds the request's state (computed tokens > 0: a later chunk of a
chunked prefill, or a decode) or must start from zeros (a first chunk, or a recompute
after preemption, which the host counts from zero again).
"""

from __future__ import annotations

import dataclasses

import torch

from atom.forward_context import AttentionMetadata


def with_state_slots(
    metadata: AttentionMetadata, state_slots: torch.Tensor, num_computed_tokens: torch.Tensor
) -> AttentionMetadata:
    """A copy of `metadata` (one step's, decodes first) with each request's state-pool
    row (`state_slots` [B], any int dtype) and its tokens computed before this step
    (`num_computed_tokens` [B])."""
    num_seqs = metadata.num_seqs
    if state_slots.shape[0] < num_seqs or num_computed_tokens.shape[0] < num_seqs:
        raise ValueError(
            f"state_slots has {state_slots.shape[0]} rows and num_computed_tokens "
            f"{num_computed_tokens.shape[0]} for a step of {num_seqs} requests"
        )
    return dataclasses.replace(
        metadata,
        state_slots=state_slots[:num_seqs].to(torch.int32),
        has_initial_state=num_computed_tokens[:num_seqs] > 0,
    )
