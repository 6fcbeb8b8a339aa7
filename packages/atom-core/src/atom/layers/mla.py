"""Multi-head latent attention (DeepSeek-V2/V3), the model side.

The layer projects hidden states to per-head queries and to one compressed latent per
token (kv_lora_rank channels, normalised, plus a rope key shared by all heads), applies
rope, and hands both to an MLA AttentionImpl, which caches the latents and attends
(atom.kernels.mla explains the two attention forms).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from atom.distributed import divide, get_tp_group
from atom.layers.attention import create_attention_impl
from atom.layers.attention_spec import AttentionSpec
from atom.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom.layers.norm import RMSNorm
from atom.layers.quantization import QuantizationConfig
from atom.layers.rotary import get_rope

# DeepSeek's reference code builds q_a_layernorm and kv_a_layernorm with the RMSNorm
# default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size]; q-LoRA when q_lora_rank is set.

    rope_interleaved: rope pairs channels (2i, 2i+1) of the rope part (DeepSeek's layout);
    otherwise (i, i + R/2). index_topk / index_head_dim: the sparse-attention fields of the
    spec (atom.layers.dsa_attention builds them).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        rope_interleaved: bool = True,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        index_topk: int = 0,
        index_head_dim: int = 0,
    ):
        super().__init__()
        self.num_heads = divide(num_heads, get_tp_group().world_size, "num_attention_heads")
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden_size, num_heads * self.qk_head_dim, False, quant_config, f"{prefix}.q_proj"
            )
        else:
            self.q_a_proj = ReplicatedLinear(
                hidden_size, q_lora_rank, bias, quant_config, f"{prefix}.q_a_proj"
            )
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                q_lora_rank, num_heads * self.qk_head_dim, False, quant_config, f"{prefix}.q_b_proj"
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden_size,
            kv_lora_rank + qk_rope_head_dim,
            bias,
            quant_config,
            f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            kv_lora_rank,
            num_heads * (qk_nope_head_dim + v_head_dim),
            False,
            quant_config,
            f"{prefix}.kv_b_proj",
        )
        self.o_proj = RowParallelLinear(
            num_heads * v_head_dim, hidden_size, bias, quant_config, f"{prefix}.o_proj"
        )
        self.rotary_emb = get_rope(
            qk_rope_head_dim, max_position, rope_parameters, is_neox_style=not rope_interleaved
        )
        # Yarn's mscale also sharpens the softmax (rotary_emb reports it; 1.0 otherwise).
        scale = self.qk_head_dim**-0.5 * self.rotary_emb.attention_scale_factor
        spec = AttentionSpec(
            layer_name=f"{prefix}.attn",
            num_heads=self.num_heads,
            num_kv_heads=1,
            head_dim=self.qk_head_dim,
            v_head_dim=v_head_dim,
            scale=scale,
            kind="MLA",
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            kv_b_proj=self.kv_b_proj,
            index_topk=index_topk,
            index_head_dim=index_head_dim,
        )
        # Built last so that its weight hook runs after kv_b_proj's own (module order).
        self.attn = create_attention_impl(spec)

    def project(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[LatentInputs, torch.Tensor | None]:
        """The impl's inputs, and the normalised q-LoRA latent (None without q-LoRA), which
        a sparse layer's indexer reads too."""
        if self.q_lora_rank is None:
            q_latent = None
            q = self.q_proj(hidden_states)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_latent)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        return LatentInputs(q_nope, q_pe, self.kv_a_layernorm(kv_c), k_pe.squeeze(1)), q_latent

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        inputs, _ = self.project(positions, hidden_states)
        return self.o_proj(self.attn(*inputs).flatten(1))


class LatentInputs(NamedTuple):
    """What an MLA impl takes: q_nope [T, H, Dn], q_pe [T, H, R] (rotated), kv_c [T, L]
    (normalised latent), k_pe [T, R] (rotated)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
