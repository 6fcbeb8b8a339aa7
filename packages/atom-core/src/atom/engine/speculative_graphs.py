"""What a speculative engine captures in CUDA graphs: the step functions and their shapes.

- The target: its forward and what the drafter reads of it (`target_features`: the final
  hidden state, or EAGLE-3's projected aux states, caught by hooks that run only while
  the graph is captured, so they must be inside it), at 1 token per sequence (a step
  without drafts) and at k + 1 (the verify step: the last token and k drafts).
- The drafter: its catch-up pass (draft step 0) at 1 to k + 1 rows per sequence (the
  tokens the target kept in the step before), and draft steps 1 to k - 1 at one row;
  each with the draft tokens (head and argmax) of every sequence's last row.

A hybrid target's verify step is captured too: its Gated DeltaNet layers keep every
sequence's states in static buffers for the rollback (state_rollback.StaticCheckpoints).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.engine.cuda_graphs import StepFunction


def target_step(model: nn.Module) -> StepFunction:
    """The target's step: (hidden,), or (hidden, drafter features) with a drafter."""
    drafter = getattr(model, "drafter", None)
    if drafter is None:
        return lambda input_ids, positions: (model(input_ids, positions),)

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = model(input_ids, positions)
        return hidden, drafter.target_features(hidden)

    return step


def drafter_step(drafter: nn.Module, step: int, query_len: int) -> StepFunction:
    """Draft step `step` over query_len rows per sequence: (draft tokens [B], states
    [B, hidden]) of each sequence's last row, the rows the proposer drafts from."""

    def run(
        input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, state = drafter(input_ids, positions, hidden, step)
        last = slice(query_len - 1, None, query_len)
        return drafter.draft_tokens(output[last], step), state[last]

    return run


def drafter_shapes(num_speculative_tokens: int) -> list[tuple[int, int]]:
    """(draft step, rows per sequence) of every drafter forward a uniform batch runs."""
    k = num_speculative_tokens
    return [(0, rows) for rows in range(1, k + 2)] + [(step, 1) for step in range(1, k)]
