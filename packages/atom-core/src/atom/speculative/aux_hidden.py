"""The target's hidden states an EAGLE-3 drafter reads, caught as the target runs.

Aux layer id i is the residual stream entering decoder layer i (hidden + residual), and id
N, for N layers, the stream leaving the last one: vLLM's convention (its
`EagleModelMixin`). Forward hooks on the decoder layers catch them, so the target's own
forward stays as it is; `take()` hands over one forward's and forgets them.
"""

from __future__ import annotations

import torch
from torch import nn


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: layers 2, N/2 and N - 3."""
    return (2, num_layers // 2, num_layers - 3)


class AuxHiddenStates:
    def __init__(self, layers: nn.ModuleList, layer_ids: tuple[int, ...]):
        """layers: the target's decoder layers, called as layer(positions, hidden, residual)
        and returning (hidden, residual); layer_ids: the ids to catch, in `take`'s order."""
        self.layer_ids = layer_ids
        self._caught: dict[int, torch.Tensor] = {}
        self._handles = []
        for index in set(layer_ids):
            if index == len(layers):
                self._handles.append(layers[-1].register_forward_hook(self._leaving(index)))
            else:
                self._handles.append(layers[index].register_forward_pre_hook(self._entering(index)))

    def _entering(self, index: int):
        def hook(_module, args):
            _, hidden, residual = args
            self._caught[index] = hidden if residual is None else hidden + residual

        return hook

    def _leaving(self, index: int):
        def hook(_module, _args, output):
            hidden, residual = output
            self._caught[index] = hidden + residual

        return hook

    def take(self) -> list[torch.Tensor]:
        """The last forward's states, in `layer_ids` order."""
        caught = [self._caught[i] for i in self.layer_ids]
        self._caught.clear()
        return caught

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
