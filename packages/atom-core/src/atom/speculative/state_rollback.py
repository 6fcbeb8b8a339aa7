"""Speculative decoding on hybrid models: Gated DeltaNet states rolled back to the
accepted tokens.

A verify step runs a sequence's new token and its k drafts through the target, and its
DeltaNet layers advance their conv and recurrent states over all k + 1 rows. Where the
verifier keeps a < k drafts, the states must stand after 1 + a rows. Before it mixes, each
layer copies the sequences' state rows and keeps their rows' inputs to the mixing (the
conv input and the gates, which do not depend on the state); the rollback puts the copies
back and mixes the kept rows again (the conv and the delta rule, not the projections or
the MLP). Sequences that keep every draft keep the states the step left.

Which sequences a step keeps:
- `ListedCheckpoints`: an eager step keeps those the host lists, the verified ones at
  their rows (a step may mix them with prefills and plain decodes).
- `StaticCheckpoints`: a step through the CUDA-graph buffers (atom.engine.cuda_graphs) is
  uniform, k + 1 rows for every sequence, so it keeps every sequence of its padded batch
  at all rows, reading the state rows from the step's static `state_slots` and writing
  into static records: a replay refreshes them with no host work inside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from atom.engine.step_arrays import to_device


@dataclass
class _LayerRecord:
    conv: torch.Tensor  # [S, C, K-1] the sequences' conv states before the step
    recurrent: torch.Tensor  # [S, Hv, Dk, Dv] and their recurrent states
    mixed: torch.Tensor  # [R, C] their rows' conv inputs
    g: torch.Tensor  # [R, Hv] their rows' decay gates
    beta: torch.Tensor  # [R, Hv] and write strengths


class StateCheckpoints:
    """What one verify step's DeltaNet layers keep of its sequences, one record per layer;
    sequence i is state row slots[i], with num_rows[i] rows in the records after those of
    the sequences before it."""

    def __init__(self, slots: torch.Tensor, num_rows: list[int]):
        self.slots = slots
        self.num_rows = num_rows
        self.records: dict[nn.Module, _LayerRecord] = {}

    def keep(
        self,
        layer: nn.Module,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> None:
        """Called by each layer before it mixes the step's rows into its states."""
        raise NotImplementedError

    def roll_back(self, kept_rows: list[int]) -> None:
        """Leaves sequence i's states after its first kept_rows[i] rows. Sequences past the
        end of kept_rows (a padded batch's padding) are left as the step left them."""
        redo = [i for i, (kept, n) in enumerate(zip(kept_rows, self.num_rows)) if kept < n]
        if not redo or not self.records:
            return
        offsets = [0, *accumulate(self.num_rows)]
        device = self.slots.device
        rows = to_device([offsets[i] + j for i in redo for j in range(kept_rows[i])], device)
        starts = to_device([0, *accumulate(kept_rows[i] for i in redo)], device, torch.int32)
        which = to_device(redo, device)
        slots = self.slots[which]
        for layer, record in self.records.items():
            layer.remix(
                slots,
                record.conv[which],
                record.recurrent[which],
                record.mixed[rows],
                record.g[rows],
                record.beta[rows],
                starts,
            )


class ListedCheckpoints(StateCheckpoints):
    """An eager verify step's checkpoints of the sequences the host lists."""

    def __init__(
        self, slots: list[int], row_starts: list[int], num_rows: list[int], device: torch.device
    ):
        """slots: the verified sequences' state rows; row_starts, num_rows: their token rows
        in the step."""
        super().__init__(to_device(slots, device), num_rows)
        rows = [r for start, n in zip(row_starts, num_rows) for r in range(start, start + n)]
        self.rows = to_device(rows, device)

    def keep(self, layer, conv_state, recurrent_state, mixed, g, beta) -> None:
        # Indexing by a tensor copies: the records outlive the step's updates.
        self.records[layer] = _LayerRecord(
            conv_state[self.slots],
            recurrent_state[self.slots],
            mixed[self.rows],
            g[self.rows],
            beta[self.rows],
        )


class StaticCheckpoints(StateCheckpoints):
    """A uniform verify step's checkpoints through static buffers: every sequence of the
    padded batch, `rows_per_seq` rows each. The records are one set per layer sized for the
    largest batch, of which a step of B sequences writes the first B: the graphs of every
    batch size share them (one copy of the states, not one per captured size), a replay
    refreshes what the rollback then reads, and a step run eagerly through the buffers
    (capture=False) overwrites them the same way, so nothing accumulates across steps.
    They are valid until the next step through these buffers."""

    def __init__(self, slots: torch.Tensor, rows_per_seq: int):
        """slots: the static `state_slots` buffer [max batch] the steps read."""
        super().__init__(slots, [rows_per_seq] * len(slots))
        self.rows_per_seq = rows_per_seq

    def keep(self, layer, conv_state, recurrent_state, mixed, g, beta) -> None:
        record = self.records.get(layer)
        if record is None:
            # Allocated by the first step, a capture's warm-up run: outside any graph's
            # memory pool, so no other graph's temporaries reuse them.
            rows = len(self.slots) * self.rows_per_seq
            record = self.records[layer] = _LayerRecord(
                conv_state.new_empty(len(self.slots), *conv_state.shape[1:]),
                recurrent_state.new_empty(len(self.slots), *recurrent_state.shape[1:]),
                mixed.new_empty(rows, *mixed.shape[1:]),
                g.new_empty(rows, *g.shape[1:]),
                beta.new_empty(rows, *beta.shape[1:]),
            )
        num_rows = mixed.shape[0]
        batch = num_rows // self.rows_per_seq
        slots = self.slots[:batch]
        torch.index_select(conv_state, 0, slots, out=record.conv[:batch])
        torch.index_select(recurrent_state, 0, slots, out=record.recurrent[:batch])
        record.mixed[:num_rows].copy_(mixed)
        record.g[:num_rows].copy_(g)
        record.beta[:num_rows].copy_(beta)
