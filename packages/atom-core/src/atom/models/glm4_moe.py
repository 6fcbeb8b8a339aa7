"""GLM-4.5 / 4.6 / 4.7 (and -Air) MoE: GQA attention, DeepSeek-V3's MoE.

Attention is Llama's with q/k/v biases (`attention_bias`; o_proj has none), per-head
RMSNorm on q and k where `use_qk_norm` says, and rotary on the first
`partial_rotary_factor` of each head (neox style). The MLP side is DeepSeek-V3's:
`first_k_dense_replace` dense layers, then a sigmoid router with a correction bias and
grouped top-k (`atom.layers.moe_routing`), routed experts plus shared experts. MTP
layers in checkpoints are skipped on load, as for DeepSeek-V3.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from atom.models.deepseek_v2 import (
    CORRECTION_BIAS_MAPPING,
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
)
from atom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class Glm4MoeDecoderLayer(DeepseekV2DecoderLayer):
    def build_attention(self, config: Any, quant_config, prefix: str) -> nn.Module:
        qk_norm = getattr(config, "use_qk_norm", False)
        return LlamaAttention(config, quant_config, prefix, qk_norm=qk_norm, o_proj_bias=False)


class Glm4MoeModel(LlamaModel):
    decoder_layer = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(DeepseekV2ForCausalLM):
    model_cls = Glm4MoeModel
    stacked_params_mapping = [*LlamaForCausalLM.stacked_params_mapping, CORRECTION_BIAS_MAPPING]
