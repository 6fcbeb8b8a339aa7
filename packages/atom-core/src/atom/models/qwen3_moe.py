"""Qwen3-MoE: Qwen3 attention with sparse MoE blocks (and optional dense layers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.layers.linear import ReplicatedLinear
from atom.layers.moe import FusedMoE
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class SparseMoeBlock(nn.Module):
    """Router + experts, as Qwen3-MoE (`mlp.gate`, `mlp.experts`) and Mixtral name them;
    `routing` is FusedMoE's routing arguments where they are not softmax top-k."""

    def __init__(
        self,
        config: Any,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        quant_config,
        prefix: str,
        **routing: Any,
    ):
        super().__init__()
        # The router stays unquantized: FP8 checkpoints keep it in high precision.
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            intermediate_size,
            renormalize=renormalize,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            **routing,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(config: Any, index: int) -> bool:
    return (
        index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        index = int(prefix.split("layers.")[1].split(".")[0])
        if is_sparse_layer(config, index):
            return SparseMoeBlock(
                config,
                config.num_experts,
                config.moe_intermediate_size,
                config.norm_topk_prob,
                quant_config,
                prefix,
            )
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)


class Qwen3MoeModel(LlamaModel):
    decoder_layer = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel
    layer_kwargs = {"qk_norm": True}

    def expert_params_mapping(self) -> list:
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.num_experts
        )
