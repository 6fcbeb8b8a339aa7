"""GPT-OSS (20B / 120B): Llama-style GQA with q/k/v/o biases, learned attention sinks,
sliding-window (`layer_types`) and full layers alternating, YaRN rotary; every layer's MLP
is a MoE whose router has a bias and picks the top-k by softmax, and whose experts have
biases and GPT-OSS's clamped SwiGLU.

HF checkpoints hold each layer's experts stacked and transposed (gate_up_proj [E, H, 2I]
with gate and up columns interleaved, down_proj [E, I, H]), or as MXFP4 blocks and scales
in the Linear layout; `load_weights` turns both into ATOM's per-expert tensors, the MXFP4
ones still packed (atom.layers.quantization.mxfp4).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atom.kernels.activation import ClampedSwiGLU
from atom.layers.linear import ReplicatedLinear
from atom.layers.moe import FusedMoE
from atom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# transformers < 5.24 has no config fields for these and uses the released models' values.
_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0


class GptOssMoE(nn.Module):
    def __init__(self, config: Any, quant_config, prefix: str):
        super().__init__()
        self.router = ReplicatedLinear(
            config.hidden_size, config.num_local_experts, bias=True, prefix=f"{prefix}.router"
        )
        activation = ClampedSwiGLU(
            getattr(config, "swiglu_alpha", _SWIGLU_ALPHA),
            getattr(config, "swiglu_limit", _SWIGLU_LIMIT),
        )
        self.experts = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,  # softmax over the top-k logits
            activation=activation,
            bias=True,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def build_attention(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return LlamaAttention(config, quant_config, prefix, sinks=True)

    def build_mlp(self, config: Any, quant_config, prefix: str) -> nn.Module:
        return GptOssMoE(config, quant_config, prefix)


class GptOssModel(LlamaModel):
    decoder_layer = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def expert_params_mapping(self) -> list:
        return FusedMoE.make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", self.config.num_local_experts
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert_tensors(weights))


def per_expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each stacked expert tensor split into per-expert gate, up
    and down tensors (`experts.{e}.gate_proj.weight`, MXFP4 `experts.{e}.gate_proj.blocks`
    and `.scales`, ...) in the Linear layout; other tensors pass through."""
    for name, tensor in weights:
        experts, sep, tensor_name = name.rpartition("experts.")
        if not sep or "." in tensor_name:
            yield name, tensor
            continue
        prefix = experts + sep
        if tensor_name.endswith(("_blocks", "_scales")):
            projection, _, part = tensor_name.rpartition("_")
            yield from _split(prefix, projection, tensor, part)
        elif tensor_name in ("gate_up_proj", "down_proj"):
            yield from _split(prefix, tensor_name, tensor.transpose(1, 2), "weight")
        elif tensor_name in ("gate_up_proj_bias", "down_proj_bias"):
            yield from _split(prefix, tensor_name.removesuffix("_bias"), tensor, "bias")
        else:
            yield name, tensor


def _split(
    prefix: str, projection: str, stacked: torch.Tensor, kind: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """stacked [E, N, ...] in the Linear layout (gate_up rows interleaved: gate, up, ...;
    for MXFP4 a row is its [K/32, 16] blocks or [K/32] scales)."""
    for expert, rows in enumerate(stacked):
        if projection == "gate_up_proj":
            yield f"{prefix}{expert}.gate_proj.{kind}", rows[0::2]
            yield f"{prefix}{expert}.up_proj.{kind}", rows[1::2]
        else:
            yield f"{prefix}{expert}.{projection}.{kind}", rows
