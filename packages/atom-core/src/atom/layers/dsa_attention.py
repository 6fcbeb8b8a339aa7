"""DeepSeek Sparse Attention: MLA whose queries attend only to the tokens a lightning
indexer selects (DeepSeek-V3.2, GLM-5).

The layer is MLA (atom.layers.mla) plus a `LightningIndexer` that reads the same q-LoRA
latent. Its impl keeps the indexer keys in the layer's pages and picks each token's top
`index_topk` cache slots (`select_tokens`); the MLA step then reads only those. A layer
built with `shared` and no indexer of its own (GLM-5's "shared" layers) attends to the
slots the last indexing layer picked in the same step.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.layers.indexer import LightningIndexer, SharedSelection
from atom.layers.mla import MultiHeadLatentAttention


class SparseLatentAttention(MultiHeadLatentAttention):
    """hidden [T, hidden_size] -> [T, hidden_size].

    mla_kwargs: MultiHeadLatentAttention's arguments (q-LoRA is required: the indexer reads
    its latent). indexer_kwargs: LightningIndexer's heads, head_dim and rope layout, or
    None for a layer that reuses `shared`'s selection. shared: where an indexing layer
    leaves its selection for the sharing layers after it.
    """

    def __init__(
        self,
        mla_kwargs: dict[str, Any],
        index_topk: int,
        indexer_kwargs: dict[str, Any] | None,
        shared: SharedSelection | None = None,
    ):
        if mla_kwargs.get("q_lora_rank") is None:
            raise ValueError("sparse attention needs q_lora_rank: its indexer reads the q latent")
        if indexer_kwargs is None and shared is None:
            raise ValueError("a layer without an indexer needs the `shared` selection it reuses")
        head_dim = indexer_kwargs["head_dim"] if indexer_kwargs else 0
        super().__init__(**mla_kwargs, index_topk=index_topk, index_head_dim=head_dim)
        self.shared = shared
        self.indexer = None
        if indexer_kwargs is not None:
            self.indexer = LightningIndexer(
                mla_kwargs["hidden_size"],
                mla_kwargs["q_lora_rank"],
                rope_dim=mla_kwargs["qk_rope_head_dim"],
                max_position=mla_kwargs["max_position"],
                rope_parameters=mla_kwargs["rope_parameters"],
                quant_config=mla_kwargs.get("quant_config"),
                prefix=f"{mla_kwargs['prefix']}.indexer",
                **indexer_kwargs,
            )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        inputs, q_latent = self.project(positions, hidden_states)
        if self.indexer is None:
            slots = self.shared.slots
        else:
            slots = self.attn.select_tokens(self.indexer(positions, hidden_states, q_latent))
            if self.shared is not None:
                self.shared.slots = slots
        return self.o_proj(self.attn.attend_selected(*inputs, slots).flatten(1))
