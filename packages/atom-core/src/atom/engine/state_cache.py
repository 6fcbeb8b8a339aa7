"""The per-request state cache of hybrid models (Gated DeltaNet layers: a conv state and a
recurrent state per sequence), beside the paged KV cache of their attention layers.

Each stateful layer owns pools of `num_slots` rows; a sequence holds one row (its slot)
from the step it is first scheduled until it finishes, is aborted or is preempted, and
reaches the layers as `AttentionMetadata.state_slots`. Row 0 is scratch: the padding rows
of a captured decode graph write there, so sequences get rows 1..max_num_seqs. The
allocator is pure Python; the pools' bytes come out of the KV-cache budget.
"""

from __future__ import annotations

import torch
from torch import nn

PADDING_SLOT = 0


def num_state_slots(max_num_seqs: int) -> int:
    """Rows of each state pool: one per concurrent sequence, and the scratch row."""
    return max_num_seqs + 1


class StateSlots:
    """Free rows of the state pools, handed out last-freed first."""

    def __init__(self, max_num_seqs: int):
        self.num_slots = num_state_slots(max_num_seqs)
        self.free = list(range(max_num_seqs, PADDING_SLOT, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(
                f"all {self.num_slots - 1} state slots are taken: the scheduler admitted more "
                "sequences than max_num_seqs"
            )
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)


def state_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "bind_state_cache")]


def is_hybrid(model: nn.Module) -> bool:
    """Whether the model keeps per-request state besides its KV cache."""
    return bool(state_layers(model))


def state_bytes_per_slot(model: nn.Module) -> int:
    return sum(
        torch.Size(shape).numel() * dtype.itemsize
        for layer in state_layers(model)
        for shape, dtype in layer.state_shapes()
    )


def allocate_state_cache(model: nn.Module, num_slots: int, device) -> int:
    """Gives every stateful layer its zeroed pools of `num_slots` rows; returns the bytes."""
    total = 0
    for layer in state_layers(model):
        pools = [
            torch.zeros((num_slots, *shape), dtype=dtype, device=device)
            for shape, dtype in layer.state_shapes()
        ]
        layer.bind_state_cache(*pools)
        total += sum(p.numel() * p.element_size() for p in pools)
    return total
