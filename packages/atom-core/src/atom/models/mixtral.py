"""Mixtral: Llama attention with sparse MoE blocks (`block_sparse_moe`, experts w1/w2/w3)."""

from __future__ import annotations

from typing import Any

from torch import nn

from atom.layers.moe import FusedMoE
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from atom.models.qwen3_moe import SparseMoeBlock


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, quant_config=None, prefix: str = "", **attn_kwargs):
        super().__init__(config, quant_config, prefix, **attn_kwargs)
        # Mixtral checkpoints name the MoE block `block_sparse_moe`, not `mlp`.
        self.block_sparse_moe = self._modules.pop("mlp")

    @property
    def mlp(self) -> nn.Module:
        return self.block_sparse_moe

    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        prefix = prefix.replace(".mlp", ".block_sparse_moe")
        return SparseMoeBlock(
            config,
            config.num_local_experts,
            config.intermediate_size,
            True,
            quant_config,
            prefix,
            **self.moe_routing(config),
        )

    def moe_routing(self, config: Any) -> dict[str, Any]:
        """FusedMoE routing arguments beyond top-k; Mixtral's softmax top-k needs none."""
        return {}


class MixtralModel(LlamaModel):
    decoder_layer = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def expert_params_mapping(self) -> list:
        return FusedMoE.make_expert_params_mapping("w1", "w2", "w3", self.config.num_local_experts)
