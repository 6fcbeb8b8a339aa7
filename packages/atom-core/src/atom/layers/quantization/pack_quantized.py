"""compressed-tensors checkpoints with 4-bit integer weights in the "pack-quantized" format
(llm-compressor's W4A16 schemes: `quant_method: "compressed-tensors"`, weights num_bits 4,
type int, strategy group or channel, symmetric or not).

Per layer: `weight_packed` int32 [N, K/8], codes packed along the input axis (element 8i + j
in nibble j); `weight_scale` [N, K/g]; for asymmetric weights `weight_zero_point` int32
[N/8, K/g], packed along the output axis; `weight_shape` [2], the unpacked [N, K]. Codes and
zero points are stored as unsigned (the signed value + 8), so the weight is
(code - zero) * scale with zero = 8 for symmetric weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.config import ConfigError
from atom.layers.quantization.base import set_weight_attrs
from atom.layers.quantization.w4a16 import (
    LayerShape,
    W4A16Config,
    W4A16LinearMethod,
    checkpoint_param,
    drop_params,
    unpack_int4,
)

_SIGNED_OFFSET = 8
STRATEGIES = ("group", "channel")


class PackQuantizedLinearMethod(W4A16LinearMethod):
    format = "compressed-tensors-w4a16"

    def create_format_weights(self, layer, shape: LayerShape, scale_dtype, weight_loader):
        k, n, g = shape.input_size, shape.output_size, shape.group_size
        group_dim = 1 if shape.groups_sharded else None
        checkpoint_param(
            layer, "weight_packed", (n, k // 8), torch.int32, (1, 0), {1: 8}, weight_loader
        )  # fmt: skip
        checkpoint_param(
            layer, "weight_scale", (n, shape.num_groups), scale_dtype, (group_dim, 0), {1: g},
            weight_loader,
        )  # fmt: skip
        if not self.config.symmetric:
            checkpoint_param(
                layer, "weight_zero_point", (n // 8, shape.num_groups), torch.int32,
                (group_dim, 0), {0: 8, 1: g}, weight_loader,
            )  # fmt: skip
        weight_shape = nn.Parameter(torch.empty(2, dtype=torch.int64), requires_grad=False)
        loader = _weight_shape_loader(layer.prefix, layer.input_size)
        layer.register_parameter(
            "weight_shape", set_weight_attrs(weight_shape, weight_loader=loader)
        )

    def decode(self, layer):
        packed, scales = drop_params(layer, "weight_packed", "weight_scale")
        del layer.weight_shape
        codes = unpack_int4(packed, dim=1).T
        if self.config.symmetric:
            zeros = torch.full_like(scales.T, _SIGNED_OFFSET, dtype=torch.int32)
        else:
            (zero_points,) = drop_params(layer, "weight_zero_point")
            zeros = unpack_int4(zero_points, dim=0).T
        return codes, zeros, scales.T, None


def _weight_shape_loader(prefix: str, input_size: int):
    """Checks a shard's unpacked [N, K] against the layer (it is not needed after)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
        if loaded.numel() != 2 or int(loaded[1]) != input_size:
            raise ConfigError(
                f"{prefix}: weight_shape {loaded.tolist()} does not match the layer's input "
                f"size {input_size}"
            )
        param.data.copy_(loaded)

    return load


class PackQuantizedConfig(W4A16Config):
    name = "compressed-tensors"
    format = "compressed-tensors-w4a16"
    method_class = PackQuantizedLinearMethod

    def __init__(self, bits, group_size, symmetric: bool, ignored: list[str]):
        super().__init__(bits, group_size, False, ignored)
        self.symmetric = symmetric

    @classmethod
    def from_dict(cls, raw: dict[str, Any], weights: dict[str, Any]) -> PackQuantizedConfig:
        """`weights`: the one config group's weight scheme."""
        if weights.get("type", "int") != "int":
            raise ConfigError(
                f"compressed-tensors pack-quantized: weights type={weights.get('type')!r} is "
                "unsupported; supported: 'int'"
            )
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"compressed-tensors pack-quantized: weights strategy={strategy!r} is "
                f"unsupported; supported: {', '.join(STRATEGIES)}"
            )
        if weights.get("actorder") == "group":
            raise ConfigError(
                "compressed-tensors pack-quantized: actorder='group' (weight_g_idx) is "
                "unsupported; supported: actorder None or 'weight'"
            )
        group_size = weights.get("group_size") if strategy == "group" else -1
        if group_size is None:
            raise ConfigError(
                "compressed-tensors pack-quantized: strategy 'group' needs weights.group_size"
            )
        symmetric = weights.get("symmetric", True)
        return cls(weights.get("num_bits"), group_size, bool(symmetric), raw.get("ignore") or [])
