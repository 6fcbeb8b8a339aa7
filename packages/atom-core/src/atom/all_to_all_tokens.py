"""Data-parallel attention + expert parallelism with an all-to-all: each token travels
only to the ranks that hold at least one of its top-k experts, and back.

`GatheredTokens` sends every token to every rank (N copies of the batch, padded to the
largest rank's count) and reduce-scatters N padded shares back. Here a token goes to the
ranks of its experts only (at most min(top_k, N), often fewer where experts of one rank
are routed together), with its full routing: the receiving rank's `local_ids` skips the
slots of other ranks' experts. Combine sends each rank's partial outputs back along the
same routes and the token's owner sums them.

The cost that makes the all-gather preferable for small batches: how many rows rank s
sends rank d depends on this layer's routing, and `all_to_all_single` takes its split
sizes as host integers. So every MoE layer first exchanges its counts (a small
all-to-all) and waits for them on the host: one device-to-host sync per layer, which
stalls the launch queue, and a step a CUDA graph cannot hold. In decode, where a step has
few tokens, that wait costs more than the rows it saves; prefill, with many tokens and
large hidden states, is where sending each token to its experts' ranks only can win.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atom.distributed import TorchDistributedGroup
from atom.expert_parallel import ExpertPlacement


@dataclass(frozen=True)
class _Routes:
    """What dispatch sent, so that combine sends the outputs back the same way."""

    token_of_row: torch.Tensor  # the local token each sent row is, rows grouped by rank
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    num_tokens: int


class AllToAllTokens:
    """Every rank holds its own batch's tokens (data-parallel attention); each token goes to
    the ranks of its experts only. The native engine's group: the hosts route their own
    data-parallel MoE."""

    def __init__(self, group: TorchDistributedGroup):
        self.group = group
        self._routes: _Routes | None = None

    def begin_step(self, tokens_per_rank: list[int]) -> None:
        """Nothing to learn: the rows each rank sends follow from each layer's routing."""

    def dispatch(self, hidden, topk_weights, topk_ids, placement: ExpertPlacement):
        num_tokens, world = hidden.shape[0], self.group.world_size
        goes_to = torch.zeros(num_tokens, world, dtype=torch.bool, device=hidden.device)
        goes_to.scatter_(1, placement.owner_ranks(topk_ids).long(), True)
        rows_to = goes_to.sum(0)
        rows_from = self.group.all_to_all(rows_to)
        # The host sync (see the module docstring): the split sizes as integers.
        counts = torch.cat([rows_to, rows_from]).tolist()
        sent, received = counts[:world], counts[world:]
        # Sent rows in rank order, each rank's in token order; their number is known now,
        # so the nonzero needs no second sync.
        _, token_of_row = goes_to.T.nonzero_static(size=sum(sent)).unbind(1)
        self._routes = _Routes(token_of_row, sent, received, num_tokens)
        return tuple(
            self.group.all_to_all(x[token_of_row], sent, received)
            for x in (hidden, topk_weights, topk_ids)
        )

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        routes = self._routes
        back = self.group.all_to_all(expert_out, routes.received, routes.sent)
        out = expert_out.new_zeros(routes.num_tokens, *expert_out.shape[1:])
        return out.index_add_(0, routes.token_of_row, back)
