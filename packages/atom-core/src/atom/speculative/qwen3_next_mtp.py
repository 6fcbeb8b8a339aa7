"""The multi-token-prediction module of Qwen3-Next and Qwen3.5, as their checkpoints ship it
(`mtp.*`):

    h = layer(fc([norm_e(embed(t[p+1])), norm_h(hidden[p])]))    logits = lm_head(norm(h))

where `layer` is a full-attention decoder layer of the target's kind (with its MoE) and
the embedding and head are the target's. The next draft reads the module's normed output
in place of the target's hidden state, as vLLM's Qwen3-Next and Qwen3.5 MTP do. Its attention keeps
its own K/V in the sequence's pages; it has no DeltaNet state, so drafting leaves the
target's states alone (their rollback after a verify step: state_rollback.py).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom.layers.linear import ReplicatedLinear
from atom.layers.norm import ZeroCentredRMSNorm

MTP_WEIGHT = "mtp.fc.weight"  # a checkpoint with this tensor carries the module


def num_mtp_layers(config: Any) -> int:
    # Their configs may not say; the released checkpoints have one layer (as vLLM assumes).
    return getattr(config, "num_nextn_predict_layers", None) or 1


class Qwen3NextMtpDrafter(nn.Module):
    def __init__(
        self,
        config: Any,
        decoder_layer: type[nn.Module],
        quant_config,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ):
        """config, decoder_layer: the target's; embed, head: its embedding and its logits."""
        super().__init__()
        from atom.models.qwen3_next import hybrid_layer_types

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed, self.head = embed, head
        self.hidden_size = hidden  # of the hidden states it reads and passes on
        self.first_index = config.num_hidden_layers
        count = num_mtp_layers(config)
        # The layers come after the target's, as full-attention layers (their index picks
        # their kind and their K/V pages).
        layer_config = copy.copy(config)
        layer_config.layer_types = hybrid_layer_types(config) + ["full_attention"] * count
        layer_config.num_hidden_layers = self.first_index + count
        self.fc = ReplicatedLinear(2 * hidden, hidden, prefix="mtp.fc")
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, eps)
        self.norm = ZeroCentredRMSNorm(hidden, eps)
        self.layers = nn.ModuleDict(
            {
                str(i): decoder_layer(layer_config, quant_config, f"model.layers.{i}")
                for i in range(self.first_index, self.first_index + count)
            }
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output, which drafts and is the next step's `hidden`)."""
        layer = self.layers[str(self.first_index + step % len(self.layers))]
        embeds = self.pre_fc_norm_embedding(self.embed(input_ids))
        joined = torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1)
        output, residual = layer(positions, self.fc(joined), None)
        normed, _ = self.norm(output, residual)
        return normed, normed

    def draft_tokens(self, output: torch.Tensor, step: int) -> torch.Tensor:
        return self.head(output).argmax(-1)

    def target_features(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return final_hidden

    def checkpoint_names(
        self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with `mtp.*` renamed to this module's parameters (under
        `prefix`): `mtp.layers.i` is layer first_index + i."""
        layer = re.compile(r"mtp\.layers\.(\d+)\.(.*)")
        for name, tensor in weights:
            if not name.startswith("mtp."):
                yield name, tensor
                continue
            match = layer.fullmatch(name)
            if match is not None:
                name = f"layers.{self.first_index + int(match[1])}.{match[2]}"
            else:
                name = name.removeprefix("mtp.")
            yield f"{prefix}.{name}", tensor
