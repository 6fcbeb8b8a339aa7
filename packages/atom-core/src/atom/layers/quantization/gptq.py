"""GPTQ checkpoints (`quant_method: "gptq"`, as AutoGPTQ / GPTQModel / optimum write them).

Per layer: `qweight` int32 [K/8, N], codes packed along the input axis (row 8i + j in
nibble j of word row i); `qzeros` int32 [K/g, N/8], packed along the output axis;
`scales` [K/g, N]; `g_idx` int32 [K], the group of each input row (not k // g with
act-order, `desc_act: true`). The original format ("gptq", v1) stores each zero point
minus one; `checkpoint_format: "gptq_v2"` stores it as is.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.config import ConfigError
from atom.layers.quantization.w4a16 import (
    LayerShape,
    W4A16Config,
    W4A16LinearMethod,
    checkpoint_param,
    drop_params,
    grouped_zeros_and_scales,
    unpack_int4,
)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqLinearMethod(W4A16LinearMethod):
    format = "gptq"

    def create_format_weights(self, layer, shape: LayerShape, scale_dtype, weight_loader):
        k, n = shape.input_size, shape.output_size
        checkpoint_param(
            layer, "qweight", (k // 8, n), torch.int32, (0, 1), {0: 8}, weight_loader
        )  # fmt: skip
        grouped_zeros_and_scales(layer, shape, scale_dtype, weight_loader)
        # The group of each input row; read for act-order only (else it is k // g). Merged
        # shards (q/k/v, gate/up) share their input, so carry the same one.
        checkpoint_param(layer, "g_idx", (k,), torch.int32, (0, None), {}, weight_loader)

    def decode(self, layer):
        qweight, qzeros, scales, g_idx = drop_params(layer, "qweight", "qzeros", "scales", "g_idx")
        codes = unpack_int4(qweight, dim=0)
        zeros = unpack_int4(qzeros, dim=1) + self.config.zero_offset
        return codes, zeros, scales, g_idx if self.config.act_order else None


class GptqConfig(W4A16Config):
    name = "gptq"
    format = "gptq"
    method_class = GptqLinearMethod

    def __init__(self, bits, group_size, act_order, ignored, checkpoint_format: str):
        super().__init__(bits, group_size, act_order, ignored)
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ConfigError(
                f"gptq: checkpoint_format={checkpoint_format!r} is unsupported; supported: "
                f"{', '.join(CHECKPOINT_FORMATS)}"
            )
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GptqConfig:
        for field in ("bits", "group_size"):
            if raw.get(field) is None:
                raise ConfigError(f"gptq: quantization_config has no {field!r}")
        if raw.get("lm_head"):
            raise ConfigError("gptq: lm_head=True (a 4-bit LM head) is unsupported")
        if raw.get("dynamic"):
            raise ConfigError(
                f"gptq: per-module overrides (dynamic={raw['dynamic']!r}) are unsupported"
            )
        return cls(
            raw["bits"],
            raw["group_size"],
            bool(raw.get("desc_act", False)),
            raw.get("modules_to_not_convert") or [],
            raw.get("checkpoint_format") or "gptq",
        )
