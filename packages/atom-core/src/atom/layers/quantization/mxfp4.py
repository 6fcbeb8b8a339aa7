"""MXFP4 checkpoints (GPT-OSS): experts stored as 4-bit e2m1 values in groups of 32 that
share one e8m0 power-of-two scale; every other layer is unquantized.

ATOM dequantizes the experts while loading (`dequantize_mxfp4`) and runs them in the
model dtype; an MXFP4 MoE kernel that keeps them packed is issue #22.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from atom.layers.quantization.base import LinearMethod, QuantizationConfig
from atom.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

# e2m1 code -> magnitude (codes 8-15: the same, negative): 2 exponent bits, 1 mantissa bit.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E8M0_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks [..., G, 16] uint8 (two codes per byte, low nibble first) and scales [..., G]
    uint8 (biased exponents) -> [..., G * 32] values in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            "pair up (blocks [..., G, 16], scales [..., G])"
        )
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=blocks.device)
    values = torch.cat([magnitudes, -magnitudes])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    exponents = scales.to(torch.int32) - _E8M0_BIAS
    out = torch.ldexp(values[codes], exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


class Mxfp4Config(QuantizationConfig):
    """Unquantized dense layers; experts are the model's to dequantize on load."""

    name = "mxfp4"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Mxfp4Config:
        logger.warning(
            "MXFP4 experts are dequantized to the model dtype at load (no MXFP4 MoE kernel "
            "yet): expert weights take 4x their checkpoint size in memory"
        )
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()

    def moe_method(self, prefix: str):
        raise NotImplementedError(
            f"{prefix}: MXFP4 experts are supported for GptOssForCausalLM checkpoints only"
        )
