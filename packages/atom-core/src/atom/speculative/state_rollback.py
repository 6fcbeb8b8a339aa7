"""Speculative decoding on hybrid models: Gated DeltaNet states rolled back to the
accepted tokens.

A verify step runs a sequence's new token and its k drafts through the target, and its
DeltaNet layers advance their conv and recurrent states over all k + 1 rows. Where the
verifier keeps a < k drafts, the states must stand after 1 + a rows. Before it mixes, each
layer copies the verified sequences' state rows and keeps their rows' inputs to the mixing
(the conv input and the gates, which do not depend on the state); the rollback puts the
copies back and mixes the kept rows again (the conv and the delta rule, not the
projections or the MLP). Sequences that keep every draft keep the states the step left.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn


@dataclass
class _LayerRecord:
    layer: nn.Module  # a GatedDeltaNet
    conv: torch.Tensor  # the verified sequences' conv states before the step
    recurrent: torch.Tensor  # and their recurrent states
    mixed: torch.Tensor  # [R, C] their rows' conv inputs
    g: torch.Tensor  # [R, Hv] their rows' decay gates
    beta: torch.Tensor  # [R, Hv] and write strengths


class StateCheckpoints:
    """What one verify step's DeltaNet layers keep of the verified sequences."""

    def __init__(
        self, slots: list[int], row_starts: list[int], num_rows: list[int], device: torch.device
    ):
        """slots: the verified sequences' state rows; row_starts, num_rows: their token rows
        in the step."""
        self.num_rows = num_rows
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        rows = [r for start, n in zip(row_starts, num_rows) for r in range(start, start + n)]
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.records: list[_LayerRecord] = []

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
        self.records.append(
            _LayerRecord(
                layer,
                conv_state[self.slots].clone(),
                recurrent_state[self.slots].clone(),
                mixed[self.rows],
                g[self.rows],
                beta[self.rows],
            )
        )

    def roll_back(self, kept_rows: list[int]) -> None:
        """Leaves verified sequence i's states after its first kept_rows[i] rows."""
        redo = [i for i, (kept, n) in enumerate(zip(kept_rows, self.num_rows)) if kept < n]
        if not redo or not self.records:
            return
        offsets = [0, *accumulate(self.num_rows)]
        device = self.slots.device
        rows = torch.tensor(
            [offsets[i] + j for i in redo for j in range(kept_rows[i])], device=device
        )
        starts = torch.tensor(
            [0, *accumulate(kept_rows[i] for i in redo)], dtype=torch.int32, device=device
        )
        which = torch.tensor(redo, device=device)
        slots = self.slots[which]
        for record in self.records:
            record.layer.remix(
                slots,
                record.conv[which],
                record.recurrent[which],
                record.mixed[rows],
                record.g[rows],
                record.beta[rows],
                starts,
            )
