"""DeepSeek-V2 and DeepSeek-V3: MLA attention, dense first layers, routed + shared experts.

The two differ only in routing, which the config names (`atom.layers.moe_routing`).
GLM-4.x MoE (`atom.models.glm4_moe`) reuses the MoE block, the layer plan and the loader;
MiniMax-M2 (`atom.models.minimax_m2`) the skipping of MTP layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import get_rope_parameters
from atom.layers.linear import ReplicatedLinear
from atom.layers.mla import MultiHeadLatentAttention
from atom.layers.moe import FusedMoE
from atom.layers.moe_routing import grouped_topk_routing
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)

# The router's bias lives next to its weight in checkpoints; FusedMoE routes with it.
CORRECTION_BIAS_MAPPING = (
    ".experts.e_score_correction_bias",
    ".gate.e_score_correction_bias",
    None,
)


def layer_index(prefix: str) -> int:
    return int(prefix.split("layers.")[1].split(".")[0])


class DeepseekV2MoE(nn.Module):
    """Routed experts plus always-on shared experts, summed."""

    def __init__(self, config: Any, quant_config=None, prefix: str = ""):
        super().__init__()
        # The router stays unquantized in DeepSeek checkpoints and runs in fp32 (as in HF).
        self.gate = ReplicatedLinear(
            config.hidden_size, config.n_routed_experts, prefix=f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            config.n_routed_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            reduce_results=True,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            **grouped_topk_routing(config),
        )
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                quant_config,
                f"{prefix}.shared_experts",
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(hidden_states.float(), self.gate.weight.float())
        out = self.experts(hidden_states, router_logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def mla_arguments(config: Any, quant_config, prefix: str) -> dict[str, Any]:
    """MultiHeadLatentAttention's arguments from a DeepSeek-shaped config."""
    return dict(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        max_position=config.max_position_embeddings,
        rope_parameters=get_rope_parameters(config),
        # V2 rotates interleaved pairs (complex rope); V3 configs may say otherwise.
        rope_interleaved=getattr(config, "rope_interleave", True),
        bias=getattr(config, "attention_bias", False),
        quant_config=quant_config,
        prefix=prefix,
    )


def _is_moe_layer(config: Any, index: int) -> bool:
    # Newer configs (V3.2, GLM-5) list each layer's MLP kind; older ones give the first
    # dense layers and a frequency. MTP layers (after the listed ones) are MoE layers.
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds is not None:
        return index >= len(kinds) or kinds[index] == "sparse"
    return bool(
        config.n_routed_experts
        and index >= config.first_k_dense_replace
        and index % getattr(config, "moe_layer_freq", 1) == 0
    )


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def build_attention(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return MultiHeadLatentAttention(**mla_arguments(config, quant_config, prefix))

    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        if _is_moe_layer(config, layer_index(prefix)):
            return DeepseekV2MoE(config, quant_config, prefix)
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)


class DeepseekV2Model(LlamaModel):
    decoder_layer = DeepseekV2DecoderLayer


class MtpLayersSkipped:
    """Mixin of a causal LM whose checkpoints carry multi-token-prediction layers after the
    last decoder layer (DeepSeek-V3, GLM-4.x MoE, MiniMax-M2): loading gives them to the
    model's MTP drafter where speculative decoding attached one, else skips them with one
    log line."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        drafter = getattr(self, "drafter", None)
        if drafter is not None:  # speculative decoding runs them (atom.speculative.mtp)
            return super().load_weights(drafter.checkpoint_names(weights, "drafter"))
        mtp_layers: set[int] = set()

        def without_mtp() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.layers."):
                    index = layer_index(name)
                    if index >= self.config.num_hidden_layers:
                        mtp_layers.add(index)
                        continue
                yield name, tensor

        loaded = super().load_weights(without_mtp())
        if mtp_layers:
            logger.info(
                "%s: skipped the checkpoint's multi-token-prediction layers %s (not run by ATOM)",
                type(self).__name__,
                sorted(mtp_layers),
            )
        return loaded


class DeepseekV2ForCausalLM(MtpLayersSkipped, LlamaForCausalLM):
    model_cls = DeepseekV2Model
    stacked_params_mapping = [
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
        CORRECTION_BIAS_MAPPING,
    ]

    def expert_params_mapping(self) -> list:
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.n_routed_experts
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
