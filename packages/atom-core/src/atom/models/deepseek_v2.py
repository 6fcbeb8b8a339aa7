"""DeepSeek-V2 and DeepSeek-V3: MLA attention, dense first layers, routed + shared experts.

The two differ only in routing, which the config names (as in DeepSeek's own code):
V2 scores experts with a softmax and picks top-k greedily or within the best groups
(`topk_method` greedy / group_limited_greedy); V3 scores with a sigmoid and picks by
score + a learned correction bias within the best groups (`noaux_tc`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import get_rope_parameters
from atom.layers.linear import ReplicatedLinear
from atom.layers.mla import MultiHeadLatentAttention
from atom.layers.moe import FusedMoE
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# Routing of configs that do not name it: what each generation's reference code does.
_DEFAULT_ROUTING = {"deepseek_v2": ("softmax", "greedy"), "deepseek_v3": ("sigmoid", "noaux_tc")}


def _layer_index(prefix: str) -> int:
    return int(prefix.split("layers.")[1].split(".")[0])


def _routing_kwargs(config: Any) -> dict[str, Any]:
    """FusedMoE routing arguments; DeepSeek always routes through `grouped_topk`, which
    without groups is plain top-k and also applies routed_scaling_factor."""
    scoring, method = _DEFAULT_ROUTING.get(config.model_type, _DEFAULT_ROUTING["deepseek_v2"])
    method = getattr(config, "topk_method", None) or method
    grouped = method in ("group_limited_greedy", "noaux_tc")
    return dict(
        scoring_func=getattr(config, "scoring_func", None) or scoring,
        use_grouped_topk=True,
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        e_score_correction_bias=method == "noaux_tc",
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=config.routed_scaling_factor,
    )


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
            **_routing_kwargs(config),
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


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def build_attention(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return MultiHeadLatentAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.q_lora_rank,
            config.kv_lora_rank,
            config.max_position_embeddings,
            get_rope_parameters(config),
            # V2 rotates interleaved pairs (complex rope); V3 configs may say otherwise.
            rope_interleaved=getattr(config, "rope_interleave", True),
            bias=getattr(config, "attention_bias", False),
            quant_config=quant_config,
            prefix=prefix,
        )

    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        index = _layer_index(prefix)
        is_moe = (
            config.n_routed_experts
            and index >= config.first_k_dense_replace
            and index % getattr(config, "moe_layer_freq", 1) == 0
        )
        if is_moe:
            return DeepseekV2MoE(config, quant_config, prefix)
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)


class DeepseekV2Model(LlamaModel):
    decoder_layer = DeepseekV2DecoderLayer


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model
    stacked_params_mapping = [
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
        (".experts.e_score_correction_bias", ".gate.e_score_correction_bias", None),
    ]

    def expert_params_mapping(self) -> list:
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.n_routed_experts
        )

    def skip_checkpoint_tensor(self, name: str) -> bool:
        # Multi-token-prediction layers follow the last decoder layer; ATOM does not run them.
        if name.startswith("model.layers.") and _layer_index(name) >= self.config.num_hidden_layers:
            return True
        return super().skip_checkpoint_tensor(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
