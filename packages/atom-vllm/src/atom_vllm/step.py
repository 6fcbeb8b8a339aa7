"""The vLLM bridge: one complete `AttentionMetadata` per step, in ATOM's forward context.

vLLM's runner builds one metadata object per KV-cache group with that group's builder
(ATOM's: `atom_vllm.backend`, each giving ATOM's schema) and maps every layer name to its
group's object in vLLM's forward context. vLLM may split layers of one kind into several
groups of equal size (e.g. Qwen3-Next's Gated DeltaNet layers into groups of as many
layers as it has attention layers), each with its own block table, slot mapping and, for
state groups, state rows.

`StepBridge` turns that, once per step, into ATOM's one object: the first group's fields,
every group's tables in `kv_group_tables`, and the positions the model was called with.
The first time, it tells each of ATOM's layers its group (`kv_group`); from then on every
ATOM impl reads only ATOM's forward context, as it does natively and in SGLang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from vllm.forward_context import get_forward_context as vllm_forward_context

from atom.forward_context import AttentionMetadata, KVGroupTables, set_forward_context


class GroupMember(Protocol):
    """One of ATOM's layers in vLLM: its name in vLLM's per-layer metadata, and the
    KV-cache group it reads."""

    layer_name: str
    kv_group: int


class StepBridge:
    """vLLM's per-layer metadata -> ATOM's step metadata, for one model's layers."""

    def __init__(self, members: Sequence[GroupMember]):
        self.members = list(members)
        self.group_leaders: list[str] | None = None  # one layer name per group, in order

    def step(self, positions: torch.Tensor) -> AbstractContextManager:
        """ATOM's forward context for the model's forward over `positions`."""
        return set_forward_context(self.metadata(positions))

    def metadata(self, positions: torch.Tensor) -> AttentionMetadata | None:
        """This step's metadata; None in vLLM's profiling and dummy runs (no metadata)."""
        return self.combine(vllm_forward_context().attn_metadata, positions)

    def combine(self, per_layer: Any, positions: torch.Tensor) -> AttentionMetadata | None:
        """vLLM's per-layer metadata (layer name -> its group's ATOM metadata) as one."""
        if isinstance(per_layer, list):  # speculative decoding: [0] is the base model's
            per_layer = per_layer[0]
        if not per_layer or not self.members:
            return None
        if self.group_leaders is None:
            self.group_leaders = self._assign_groups(per_layer)
        groups = [per_layer[name] for name in self.group_leaders]
        first = groups[0]
        return dataclasses.replace(
            first,
            positions=positions,
            kv_group_tables=tuple(
                KVGroupTables(g.block_table, g.slot_mapping, g.state_slots) for g in groups
            ),
            has_initial_state=next(
                (g.has_initial_state for g in groups if g.has_initial_state is not None), None
            ),
        )

    def _assign_groups(self, per_layer: dict[str, Any]) -> list[str]:
        """Numbers vLLM's groups in the order of ATOM's layers (the layers of a group share
        one metadata object) and tells every layer its number."""
        leaders: list[str] = []
        numbers: dict[int, int] = {}
        for member in self.members:
            group = numbers.setdefault(id(per_layer[member.layer_name]), len(leaders))
            if group == len(leaders):
                leaders.append(member.layer_name)
            member.kv_group = group
        return leaders
