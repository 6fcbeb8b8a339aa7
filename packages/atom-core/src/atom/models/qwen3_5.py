"""Qwen3.5 (dense MLP) and Qwen3.5-MoE: Qwen3-Next's hybrid layers with the DeltaNet's
input projections split by role (in_proj_qkv rows [q | k | v] of all heads, in_proj_z,
in_proj_b, in_proj_a), and every MoE layer's router renormalising its top-k.

Their rotary is multimodal (mrope sections over time/height/width positions); for text
all three positions are the token's position, which is plain rotary. The released
checkpoints are multimodal (`Qwen3_5ForConditionalGeneration`, text model under
`text_config` and `model.language_model.*`): ATOM runs the text model and skips the
vision tower with one log line (atom.models.qwen3_next).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.distributed import get_tp_group
from atom.layers.gated_delta_net import GatedDeltaNet
from atom.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from atom.models.llama import LlamaMLP
from atom.models.qwen3_next import (
    HybridModel,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    SharedExpertMoE,
)


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def build_projections(self, config: Any, quant_config, prefix: str) -> None:
        tp_size = get_tp_group().world_size
        sizes = [size * tp_size for size in (self.key_dim, self.key_dim, self.value_dim)]
        self.in_proj_qkv = MergedColumnParallelLinear(
            config.hidden_size, sizes, quant_config=quant_config, prefix=f"{prefix}.in_proj_qkv"
        )
        load_as_shards(self.in_proj_qkv, sizes)
        for name, width in (
            ("in_proj_z", self.value_dim),
            ("in_proj_b", self.num_v_heads),
            ("in_proj_a", self.num_v_heads),
        ):
            layer = ColumnParallelLinear(
                config.hidden_size,
                width * tp_size,
                quant_config=quant_config,
                prefix=f"{prefix}.{name}",
            )
            setattr(self, name, layer)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


def load_as_shards(linear: MergedColumnParallelLinear, sizes: list[int]) -> None:
    """For a checkpoint that stores a merged projection as one tensor of `sizes` rows
    (every rank's rows of each part together): each parameter's loader splits it into
    the parts and loads each as its shard, so tensor parallelism slices every part."""
    for param in linear.parameters():
        if getattr(param, "output_dim", None) is None:
            continue
        block = getattr(param, "shard_block", 1)
        rows = [-(-size // block) for size in sizes]

        def load(param: nn.Parameter, loaded: torch.Tensor, *_, rows=rows) -> None:
            for index, part in enumerate(loaded.split(rows, dim=param.output_dim)):
                linear.weight_loader(param, part, index)

        param.weight_loader = load


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    linear_attention_cls = Qwen3_5GatedDeltaNet

    def build_mlp(self, config: Any, quant_config, prefix: str, index: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, quant_config, prefix)


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    linear_attention_cls = Qwen3_5GatedDeltaNet

    def build_mlp(self, config: Any, quant_config, prefix: str, index: int) -> nn.Module:
        return SharedExpertMoE(config, quant_config, prefix, renormalize=True)


class Qwen3_5Model(HybridModel):
    decoder_layer = Qwen3_5DecoderLayer


class Qwen3_5MoeModel(HybridModel):
    decoder_layer = Qwen3_5MoeDecoderLayer


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5Model


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5MoeModel
