"""Multi-token prediction layers, as DeepSeek-V3 and GLM-4.5 checkpoints ship them.

Layer `num_hidden_layers + i` of the checkpoint predicts one token further ahead: at
position p it takes the target's hidden state at p and the embedding of token p + 1,

    h = block(eh_proj([enorm(embed(t[p+1])), hnorm(hidden[p])]))    logits = head(norm(h))

where `block` is a decoder layer of the target's own kind. Its attention keeps its own
K/V in the sequence's pages, at the target's positions. For the next draft the layer
reads its own output in place of the target's hidden state (normed where the family's
reference implementation norms it). Position 0 sees a zero embedding, as in vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom.layers.embedding import ParallelLMHead
from atom.layers.linear import ReplicatedLinear
from atom.layers.norm import RMSNorm

# Checkpoint name suffixes of an MTP layer that are not its decoder block's.
_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class MtpLayer(nn.Module):
    def __init__(self, config: Any, decoder_layer: type[nn.Module], quant_config, prefix: str):
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, prefix=f"{prefix}.eh_proj")
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.shared_head.head = ParallelLMHead(config.vocab_size, hidden)
        self.mtp_block = decoder_layer(config, quant_config, prefix)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output [T, hidden] before its final norm."""
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        joined = torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1)
        hidden, residual = self.mtp_block(positions, self.eh_proj(joined), None)
        return hidden + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))


class MtpDrafter(nn.Module):
    """The checkpoint's MTP layers; draft step j runs layer j modulo their number.

    recycle_normed: the next draft reads the layer's normed output (DeepSeek-V3) or its
    raw output (GLM-4.5), as each family's reference implementation does."""

    def __init__(
        self,
        config: Any,
        decoder_layer: type[nn.Module],
        quant_config,
        recycle_normed: bool,
        embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """config: the target's; decoder_layer: the target's decoder layer class; embed:
        the target's embedding (the checkpoint's copy in each MTP layer is the same)."""
        super().__init__()
        self.embed = embed
        self.hidden_size = config.hidden_size  # of the hidden states it reads and passes on
        self.first_index = config.num_hidden_layers
        self.recycle_normed = recycle_normed
        self.layers = nn.ModuleDict(
            {
                str(i): MtpLayer(config, decoder_layer, quant_config, f"model.layers.{i}")
                for i in range(self.first_index, self.first_index + config.num_nextn_predict_layers)
            }
        )

    def layer(self, step: int) -> MtpLayer:
        return self.layers[str(self.first_index + step % len(self.layers))]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the output rows `draft_tokens` reads, the state the next draft step reads);
        `hidden` is the target's final hidden state at step 0, then that state."""
        layer = self.layer(step)
        output = layer(self.embed(input_ids), positions, hidden)
        normed = layer.shared_head.norm(output)
        return normed, normed if self.recycle_normed else output

    def draft_tokens(self, output: torch.Tensor, step: int) -> torch.Tensor:
        return self.layer(step).shared_head.head(output).argmax(-1)

    def target_features(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return final_hidden

    def checkpoint_names(
        self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The target's checkpoint stream with MTP tensors renamed to this module's
        parameters (under `prefix`); their copy of the embedding is the target's own and
        is dropped."""
        pattern = re.compile(r"model\.layers\.(\d+)\.(.*)")
        for name, tensor in weights:
            match = pattern.fullmatch(name)
            if match is None or int(match[1]) < self.first_index:
                yield name, tensor
                continue
            index, rest = match[1], match[2]
            if rest.startswith("embed_tokens."):
                continue
            inner = rest if rest.startswith(_OWN_PARTS) else f"mtp_block.{rest}"
            yield f"{prefix}.layers.{index}.{inner}", tensor
