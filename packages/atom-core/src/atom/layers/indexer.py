"""The lightning indexer of DeepSeek Sparse Attention, the model side (DeepSeek-V3.2, GLM-5).

Beside each MLA layer, a few small heads score past tokens so that the layer attends only
to the best `index_topk` of them. The indexer projects the layer's q-LoRA latent to Hi
query heads of Di channels, the hidden state to one key of Di channels (LayerNorm'd) and
to one weight per head; rope turns the first qk_rope_head_dim channels of each. Its MLA
impl caches the keys and selects the tokens (atom.kernels.indexer gives the score).

DeepSeek's reference quantizes q and k to FP8 after a Hadamard rotation; the rotation
keeps dot products, and HF transformers (the reference ATOM is checked against) scores
in the model's dtype, as here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom.layers.linear import ReplicatedLinear
from atom.layers.quantization import QuantizationConfig
from atom.layers.rotary import get_rope

# The key LayerNorm's eps in DeepSeek's reference and HF transformers.
KEY_NORM_EPS = 1e-6


@dataclass(frozen=True)
class IndexerQuery:
    """One step's indexer inputs: q [T, Hi, Di] and k [T, Di] rotated, and weights [T, Hi]
    (fp32) with the softmax scale Di^-0.5 and Hi^-0.5 folded in."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor


class LightningIndexer(nn.Module):
    """hidden [T, hidden_size] and the q-LoRA latent [T, q_lora_rank] -> IndexerQuery.

    rope_interleaved: rope pairs channels (2i, 2i+1) (GLM-5); otherwise (i, i + R/2)
    (DeepSeek-V3.2). The heads are not split over tensor parallelism (they are few and
    every rank selects for all its heads).
    """

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        rope_interleaved: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.wq_b = ReplicatedLinear(
            q_lora_rank, num_heads * head_dim, False, quant_config, f"{prefix}.wq_b"
        )
        self.wk = ReplicatedLinear(hidden_size, head_dim, False, quant_config, f"{prefix}.wk")
        self.k_norm = nn.LayerNorm(head_dim, eps=KEY_NORM_EPS)
        # Unquantized in the checkpoints, and run in fp32 (as HF does).
        self.weights_proj = ReplicatedLinear(
            hidden_size, num_heads, prefix=f"{prefix}.weights_proj"
        )
        self.weight_scale = (num_heads * head_dim) ** -0.5
        self.rotary_emb = get_rope(
            head_dim, max_position, rope_parameters, rope_dim, is_neox_style=not rope_interleaved
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, q_latent: torch.Tensor
    ) -> IndexerQuery:
        q = self.wq_b(q_latent).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(1)
        q, k = self.rotary_emb(positions, q, k)
        weights = F.linear(hidden_states.float(), self.weights_proj.weight.float())
        return IndexerQuery(q, k.squeeze(1), weights * self.weight_scale)


class SharedSelection:
    """The top-k slots of the last layer that ran its indexer, for the layers that reuse
    them (GLM-5's "shared" layers). Layers run in order within a step, so a sharing layer
    always reads its step's selection."""

    slots: torch.Tensor | None = None
