"""MiniMax-M2: GQA attention with QK-norm over all heads and partial rotary, sparse MoE
with a sigmoid router.

Attention is Llama's without biases, with rotary (neox style) on the first `rotary_dim`
features of each head and, where `use_qk_norm`, one RMSNorm over the whole q projection
(all heads' features together, not per head) and one over the whole k projection, before
rope. Under tensor parallelism that norm's mean square is averaged over the ranks
(`atom.layers.norm.ShardedRMSNorm`). Every layer's MLP is Mixtral's block (`block_sparse_moe`,
experts w1/w2/w3) routed as HF's MiniMaxM2TopKRouter (`atom.layers.moe_routing`). MTP
layers in checkpoints are skipped on load, as for DeepSeek-V3.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.config import ConfigError
from atom.distributed import get_tp_group
from atom.layers.moe_routing import minimax_m2_routing
from atom.layers.norm import ShardedRMSNorm, sharded_rms_norm
from atom.models.deepseek_v2 import MtpLayersSkipped
from atom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from atom.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        # Released checkpoints give the rotary width as `rotary_dim` (transformers 5.12
        # does not turn it into partial_rotary_factor).
        super().__init__(
            config, quant_config, prefix, rotary_dim=getattr(config, "rotary_dim", None)
        )
        qk_norm_type = getattr(config, "qk_norm_type", "per_layer")
        if qk_norm_type != "per_layer":
            raise ConfigError(
                f"MiniMax-M2 config field qk_norm_type={qk_norm_type!r} is not supported "
                "(only 'per_layer': one norm over all heads)"
            )
        # HF's MiniMax-M2 always normalises q and k; the released configs say so explicitly.
        self.use_qk_norm = getattr(config, "use_qk_norm", True)
        if self.use_qk_norm:
            rank = get_tp_group().rank
            self.q_norm = ShardedRMSNorm(self.q_size, rank, config.rms_norm_eps)
            kv_shard = rank // self.qkv_proj.kv_replicas
            self.k_norm = ShardedRMSNorm(self.kv_size, kv_shard, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            q, k = sharded_rms_norm([q, k], [self.q_norm, self.k_norm])
        return self.o_proj(self.attn(q, k, v, positions))


class MiniMaxM2DecoderLayer(MixtralDecoderLayer):
    def build_attention(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return MiniMaxM2Attention(config, quant_config, prefix)

    def moe_routing(self, config: Any) -> dict[str, Any]:
        return minimax_m2_routing(config)


class MiniMaxM2Model(LlamaModel):
    decoder_layer = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(MtpLayersSkipped, MixtralForCausalLM):
    model_cls = MiniMaxM2Model
    # The router's correction bias sits on the MoE block in checkpoints; FusedMoE routes with it.
    stacked_params_mapping = [
        *LlamaForCausalLM.stacked_params_mapping,
        (
            ".block_sparse_moe.experts.e_score_correction_bias",
            ".block_sparse_moe.e_score_correction_bias",
            None,
        ),
    ]
